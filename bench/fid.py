"""Benchmark of the fid package: Inception throughput, Fréchet-distance methods, memory of statistics.

    python -m bench.fid            # full: 2048-d Fréchet, 50 000 simulated features
    python -m bench.fid --quick    # smoke run in well under a minute

Writes bench/results/fid-<device>[-quick].json, a Markdown table (.md) and a plot (.png).
Run CPU benchmarks with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 (see the Makefile).
"""

import multiprocessing
import re
import time
from pathlib import Path

import numpy as np
import scipy.linalg
import torch
from matplotlib.figure import Figure

from bench._harness import benchmark_parser, save_results, subplots, synchronize
from fid import FeatureMoments, Gaussian, frechet_distance, load_inception
from fid.inception_spec import POOL_DIM

SETTINGS = {  # full vs --quick sizes
    "full": {
        "cpu_images": 64,
        "gpu_images": 2000,
        "frechet_dim": POOL_DIM,
        "frechet_repeats": 3,
        "memory_features": 50_000,
    },
    "quick": {"cpu_images": 4, "gpu_images": 400, "frechet_dim": 384, "frechet_repeats": 1, "memory_features": 5_000},
}
BATCH_SIZE = {"cpu": 8, "cuda": 200}


def bench_inception(device: str, num_images: int) -> dict:
    """Images per second through resize + Inception-v3 (fp32, bundled weights), after one warm-up batch."""
    extractor = load_inception("bundled", device)
    batch_size = min(BATCH_SIZE[torch.device(device).type], num_images)
    images = np.random.default_rng(0).integers(0, 256, (batch_size, 256, 256, 3), dtype=np.uint8)
    extractor(images)  # warm-up: allocations, cuDNN algorithm choice
    synchronize(device)
    start = time.perf_counter()
    for _ in range(num_images // batch_size):
        extractor(images)
    synchronize(device)
    seconds = time.perf_counter() - start
    count = batch_size * (num_images // batch_size)
    return {
        "device": device,
        "images": count,
        "batch_size": batch_size,
        "input_size": 256,
        "seconds": seconds,
        "images_per_s": count / seconds,
    }


def _from_trace_sqrt(a: Gaussian, b: Gaussian, trace_sqrt: float) -> float:
    diff = a.mean - b.mean
    return float(diff @ diff + np.trace(a.cov) + np.trace(b.cov) - 2 * trace_sqrt)


def _sqrtm(a: Gaussian, b: Gaussian) -> float:
    """pytorch-fid / ADM's variant: scipy's general matrix square root of S_a S_b."""
    return _from_trace_sqrt(a, b, np.trace(scipy.linalg.sqrtm(a.cov @ b.cov).real))


def _eigvals(a: Gaussian, b: Gaussian) -> float:
    """torch-fidelity 0.4's variant: square roots of the (non-symmetric) eigenvalues of S_a S_b."""
    return _from_trace_sqrt(a, b, np.sqrt(np.linalg.eigvals(a.cov @ b.cov).astype(complex)).real.sum())


def bench_frechet(dim: int, repeats: int) -> dict:
    """Seconds per Fréchet distance of full-rank dim-d statistics, three methods, and their agreement."""
    rng = np.random.default_rng(0)
    gaussians = []
    for shift in (0.0, 0.1):
        x = np.abs(rng.normal(size=(2 * dim + 1000, dim)) @ rng.normal(size=(dim, dim)) / np.sqrt(dim) + shift)
        gaussians.append(Gaussian(x.mean(0), np.cov(x, rowvar=False)))
    methods = {
        "eigh (ours)": frechet_distance,
        "sqrtm (pytorch-fid, ADM)": _sqrtm,
        "eigvals (torch-fidelity)": _eigvals,
    }
    result = {"dim": dim, "repeats": repeats, "methods": {}}
    for name, method in methods.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            value = method(*gaussians)
            times.append(time.perf_counter() - start)
        result["methods"][name] = {"seconds": min(times), "value": value}
    reference = result["methods"]["eigh (ours)"]["value"]
    for entry in result["methods"].values():
        entry["relative_difference_to_eigh"] = abs(entry["value"] - reference) / abs(reference)
    return result


def _memory_worker(mode: str, num_features: int, connection) -> None:
    """Child process: accumulate simulated pool_3 features one way, send the peak RSS growth in MiB."""
    batch_size, rng = 256, np.random.default_rng(0)
    baseline = _peak_rss_mib()
    moments, kept = FeatureMoments(POOL_DIM), []
    for start in range(0, num_features, batch_size):
        count = min(batch_size, num_features - start)
        batch = rng.random((count, POOL_DIM), dtype=np.float32)  # float32, like Inception's output
        if mode == "streaming":
            moments.update(torch.from_numpy(batch))
        else:
            kept.append(batch)
    if mode == "streaming":
        moments.gaussian()
    else:  # what torch-fidelity and pytorch-fid do: all features, then np.mean / np.cov
        features = np.concatenate(kept)
        _ = features.mean(0), np.cov(features, rowvar=False)
    connection.send(_peak_rss_mib() - baseline)


def _peak_rss_mib() -> float:
    """This process's resident-memory high-water mark (VmHWM), which a forked child starts afresh."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def bench_memory(num_features: int) -> dict:
    """Peak memory growth of streaming vs in-memory statistics, each in a forked child.

    Run first, while the parent holds little freed heap that a child could reuse unseen."""
    context = multiprocessing.get_context("fork")  # fork: no second import of torch
    result = {"features": num_features, "dim": POOL_DIM}
    for mode in ("streaming", "in-memory"):
        receiver, sender = context.Pipe(duplex=False)
        worker = context.Process(target=_memory_worker, args=(mode, num_features, sender))
        worker.start()
        result[mode] = receiver.recv()
        worker.join()
    return result


def device_label(device: str) -> str:
    if torch.device(device).type == "cpu":
        return "cpu"
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def markdown(results: dict) -> str:
    lines = ["| benchmark | setting | result |", "|---|---|---|"]
    for run in results["inception"]:
        lines.append(
            f"| Inception-v3 features, fp32 | {run['device']}, batch {run['batch_size']}, "
            f"{run['input_size']}px input | {run['images_per_s']:.1f} images/s |"
        )
    frechet = results["frechet"]
    for name, entry in frechet["methods"].items():
        lines.append(
            f"| Fréchet distance, {frechet['dim']}-d | {name} | {entry['seconds']:.2f} s "
            f"(rel. diff. to eigh {entry['relative_difference_to_eigh']:.1e}) |"
        )
    memory = results["memory"]
    for mode in ("streaming", "in-memory"):
        lines.append(
            f"| statistics of {memory['features']:,} x {memory['dim']} features | {mode} | "
            f"{memory[mode]:.0f} MiB peak growth |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict) -> Figure:
    figure, (left, right) = subplots(1, 2, figsize=(10, 3.5))
    methods = results["frechet"]["methods"]
    left.barh(list(methods), [m["seconds"] for m in methods.values()])
    left.set_xlabel("seconds")
    left.set_title(f"Fréchet distance, {results['frechet']['dim']}-d")
    memory = results["memory"]
    right.bar(["streaming", "in-memory"], [memory["streaming"], memory["in-memory"]])
    right.set_ylabel("MiB")
    right.set_title(f"peak memory, {memory['features']:,} features")
    figure.tight_layout()
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, quick="small sizes: a smoke run in well under a minute", device=False)
    args = parser.parse_args()

    setting = SETTINGS["quick" if args.quick else "full"]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    memory = bench_memory(setting["memory_features"])
    results = {
        "setting": "quick" if args.quick else "full",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "inception": [bench_inception(d, setting["gpu_images" if d == "cuda" else "cpu_images"]) for d in devices],
        "frechet": bench_frechet(setting["frechet_dim"], setting["frechet_repeats"]),
        "memory": memory,
    }
    stem = f"fid-{device_label(devices[-1])}" + ("-quick" if args.quick else "")
    save_results(args.out, stem, results, markdown(results), plot)
    print(markdown(results))
    print(f"written: {args.out / stem}.json, .md, .png")


if __name__ == "__main__":
    main()
