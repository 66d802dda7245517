"""Benchmark: VCA's Triton kernels compiled for the GPUs and Triton versions users have, without a GPU.

The compile matrix: every kernel of VCA's Triton core × every tile configuration it declares (dit_vca/
vca_triton_configs.py) × GPU targets sm_100 (B200), sm_90 (H100/H200), sm_80 (A100) × Triton 3.6.0 (what torch 2.10
and 2.11 pin), 3.5.1 (torch 2.9.1) and the venv's own × the cases `CASES` (precision, head dim), for the released
switches (`--all-switches`: all 16 combinations), on both of the core's paths. The kernels and their arguments are
found by running a VCA layer (bench.triton_launches); each (launch, configuration, target, version) is compiled
once, by `triton.compile` for that GPU target in a process of that Triton (bench.triton_worker). A row: compiled or
the error's first line, shared memory, registers and spilled bytes per thread, the atomic instructions in the PTX
and the GPU-scope memory fences in the SASS (issue 46: an acq_rel atomic add compiles to MEMBAR.ALL.GPU + ATOMG +
CCTL.IVALL on sm_90; the kernels have none), compile time.

The other Triton versions live in their own folders under VCA_TRITON_VERSIONS (default ~/.cache/dit-vca/triton),
never in the project's environment: `python -m bench.triton_compile --install` (make triton-versions) installs them.

The committed result, bench/results/triton-compile.{json,md,png}, is the matrix's summary: the kernels' source
hashes and declared configurations it was compiled from, and a row per compilation (no cache keys). A local log of
rows (ROW_LOG) lets a stopped run resume where it stopped; nothing committed is a cache. A configuration that must
not run somewhere is declared so beside it (dit_vca.vca_triton_configs); tests/test_triton_compile.py checks those
declarations and the rows against each other.

Usage: python -m bench.triton_compile [--targets sm_100 sm_90 sm_80] [--versions 3.6.0 ...] [--all-switches]
       python -m bench.triton_compile --quick        # sm_90, the venv's Triton, bf16 at d = 64 and 72: a few minutes
       python -m bench.triton_compile --cases fp16/72 ieee/72   # other cases
       python -m bench.triton_compile --install      # the pinned Triton versions, each into its own folder
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from bench._harness import benchmark_parser, save_results, subplots
from bench.triton_launches import STALE_SOURCE
from dit_vca.vca_triton_configs import CONFIGS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("sm_100", "sm_90", "sm_80")  # compiled in this order: the newest GPUs first
PINNED = {"3.6.0": "torch 2.10, 2.11", "3.5.1": "torch 2.9.1"}  # Triton versions the supported torch versions pin
# The cases compiled: (precision, head dim). bf16 at DiT-S/B/L's d = 64 and DiT-XL's 72 (where the kernels must not
# spill on sm_90), float32 with TF32 products at d = 128 (the most shared memory: A100's limit is the tightest). fp16
# compiles as bf16 does but for the dtype, IEEE float32 as TF32 but without tensor cores; `--cases` adds them.
CASES = (("bf16", 64), ("bf16", 72), ("tf32", 128))
QUICK_CASES = (("bf16", 64), ("bf16", 72))
# The most shared memory one block may use (CUDA C Programming Guide, compute capabilities table): 163 KiB on
# sm_80, 227 KiB on sm_90 and sm_100. A configuration over it compiles, and fails to launch there.
SHARED_LIMITS = {"sm_80": 163 * 1024, "sm_90": 227 * 1024, "sm_100": 227 * 1024}
VERSIONS_DIR = Path(os.environ.get("VCA_TRITON_VERSIONS") or Path.home() / ".cache" / "dit-vca" / "triton")
ROW_LOG = VERSIONS_DIR / "compiled-rows.jsonl"  # every row compiled here, by key: what a stopped run resumes from
STEM = "triton-compile"
COLUMNS = ("kernel", "config", "target", "version", "cases", "ok", "error", "shared", "registers", "spill_stores",
           "atomics", "gpu_fences", "seconds")  # fmt: skip


def venv_version() -> str:
    return importlib.metadata.version("triton")


def version_folder(version: str) -> Path | None:
    """The folder a Triton version is imported from (first on PYTHONPATH), None for the venv's own."""
    return None if version == venv_version() else VERSIONS_DIR / version


def missing_versions(versions: list[str]) -> list[str]:
    return [v for v in versions if (f := version_folder(v)) is not None and not (f / "triton" / "__init__.py").exists()]


def install(versions: list[str]) -> None:
    """pip-installs each missing version into its own folder (a partial install is never taken for one)."""
    for version in missing_versions(versions):
        folder = version_folder(version)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(partial)]
        subprocess.run([*pip, f"triton=={version}"], check=True)
        partial.rename(folder)


def compiler_environment(version: str, cache: Path) -> dict[str, str]:
    """A subprocess that compiles: Triton `version` first on the path, no interpreter, no GPU visible (so that the
    launches are the declared ones), ptxas's report printed, a Triton cache of its own (so that every compilation
    runs and reports)."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    folder = version_folder(version)
    if folder is not None:
        environment["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT)])
    environment |= {"CUDA_VISIBLE_DEVICES": "", "TRITON_DUMP_PTXAS_LOG": "1", "TRITON_CACHE_DIR": str(cache)}
    return environment | {"OMP_NUM_THREADS": "1"}


def discover(all_switches: bool = False) -> dict:
    """bench.triton_launches.discover() in a subprocess where Triton compiles (the venv's own)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "launches.json"
        command = [sys.executable, "-m", "bench.triton_launches", str(out)] + (
            ["--all-switches"] if all_switches else []
        )
        done = subprocess.run(command, cwd=ROOT, env=compiler_environment(venv_version(), Path(scratch) / "cache"),
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"discovering the kernels' launches failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def case_name(case: list) -> str:
    """ "bf16/72/per-head" from a spec's case [precision, d, switches, geometry]."""
    precision, d, _, geometry = case
    return f"{precision}/{d}/{geometry}"


def job(spec: dict, config, target: str, version: str, cases: list[list]) -> dict:
    """One compilation: a launch spec in one declared configuration (a TileConfig: its blocks replace the spec's)
    for one target with one Triton version. Its key is the content it compiles (the kernel's source among it)."""
    compiled = {"params": dict(config.blocks), "num_warps": config.num_warps, "num_stages": config.num_stages}
    identity = [spec["kernel"], spec["source"], spec["args"], compiled, target, version]
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return {"key": key, "kernel": spec["kernel"], "name": spec["name"], "source": spec["source"],
            "args": spec["args"], "config": compiled, "label": config.name, "target": target, "version": version,
            "cases": sorted(case_name(c) for c in cases)}  # fmt: skip


def plan(discovery: dict, targets: list[str], versions: list[str], cases=CASES) -> list[dict]:
    """Every job of the matrix: each spec that one of `cases` launches, in each configuration its kernel declares,
    for each target and version."""
    wanted = {tuple(case) for case in cases}
    jobs = []
    for target in targets:
        for version in versions:
            for spec in discovery["specs"]:
                covered = [c for c in spec["cases"] if (c[0], c[1]) in wanted]
                if covered:
                    jobs += [job(spec, c, target, version, covered) for c in CONFIGS[spec["name"]].compiled]
    return jobs


def block_order(targets: list[str], versions: list[str]) -> list[tuple[str, str]]:
    """(target, version) pairs in compile order: version by version (the pinned ones first) for sm_100 and sm_90,
    then sm_80."""
    newest = [t for t in targets if t != "sm_80"]
    return [(t, v) for v in versions for t in newest] + [("sm_80", v) for v in versions if "sm_80" in targets]


def read_row_log(row_log: Path) -> dict[str, dict]:
    """Rows by key from a row log (a line cut by a kill is skipped)."""
    if not row_log.exists():
        return {}
    return {
        row["key"]: row
        for row in map(json.loads, filter(lambda line: line.endswith("}"), row_log.read_text().splitlines()))
    }


def compile_jobs(jobs: list[dict], version: str, rows: dict[str, dict], row_log: Path = ROW_LOG) -> None:
    """Compiles those of `jobs` (one version's) that `rows` lacks, in worker processes one at a time, which append
    each row to `row_log` as it comes; then adds them to `rows`. A worker that dies (a crash inside the compiler)
    leaves its job as a failed row and another worker goes on with the rest."""
    row_log.parent.mkdir(parents=True, exist_ok=True)
    pending = [job for job in jobs if job["key"] not in rows]
    with tempfile.TemporaryDirectory() as scratch:
        jobs_file, log = Path(scratch) / "jobs.json", Path(scratch) / "worker.log"
        while pending:
            jobs_file.write_text(json.dumps(pending))
            worker = [sys.executable, "-m", "bench.triton_worker", str(jobs_file), str(row_log)]
            with log.open("w") as log_file:
                done = subprocess.run(worker, cwd=ROOT, env=compiler_environment(version, Path(scratch) / "cache"),
                                      stdout=log_file, stderr=subprocess.STDOUT)  # fmt: skip
            output = log.read_text(errors="replace")
            if done.returncode == STALE_SOURCE:  # edited since discover(): its rows would describe other code
                print(f"bench.triton_compile: {output.strip().splitlines()[-1]}", file=sys.stderr)
                raise SystemExit(2)
            if done.returncode != 0 and "compiling " not in output:
                raise RuntimeError(f"the Triton {version} worker failed before compiling:\n{output[-3000:]}")
            rows |= {key: row for key, row in read_row_log(row_log).items() if key in {j["key"] for j in pending}}
            if done.returncode != 0:  # the job it was compiling when it died
                crashed = next(j for j in pending if j["key"] == output.rsplit("compiling ", 1)[1].split()[0])
                row = {"key": crashed["key"], "ok": False}
                row["error"] = f"the compiler process died (exit status {done.returncode})"
                with row_log.open("a") as rows_file:
                    rows_file.write(json.dumps(row) + "\n")
                rows[row["key"]] = row
            pending = [job for job in pending if job["key"] not in rows]


def summary(discovery: dict, jobs: list[dict], rows: dict[str, dict], versions: list[str]) -> dict:
    """The committed result: what was compiled (kernels' source hashes and declared configurations, targets,
    versions, cases) and a row per compilation."""
    table = []
    for job in jobs:
        row = rows.get(job["key"])
        if row is not None:
            merged = {"kernel": job["name"], "config": job["label"], "target": job["target"], "version": job["version"],
                      "cases": job["cases"]} | {k: row.get(k) for k in COLUMNS[5:]}  # fmt: skip
            table.append([merged[column] for column in COLUMNS])
    return {
        "benchmark": STEM,
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(),
        "versions": {v: PINNED.get(v, "this environment's") for v in versions},
        "targets": sorted({job["target"] for job in jobs}, key=TARGETS.index),
        "cases": sorted({(c.split("/")[0], int(c.split("/")[1])) for job in jobs for c in job["cases"]}),
        "switches": discovery["switches"],
        "geometries": discovery["geometries"],
        "kernels": dict(sorted(discovery["kernels"].items())),
        "configs": {name: [c.name for c in CONFIGS[name].compiled] for name in sorted(discovery["kernels"])},
        "shared_limits": SHARED_LIMITS,
        "planned": len(jobs),
        "columns": list(COLUMNS),
        "rows": table,
    }


def describe_machine() -> str:
    import torch

    from bench._harness import describe_device

    return describe_device(torch.device("cpu"))


def markdown(results: dict) -> str:
    rows = [dict(zip(results["columns"], row)) for row in results["rows"]]
    limits = results["shared_limits"]
    versions = list(results["versions"])
    lines = [
        f"# Triton compile matrix ({results['date']}, {results['machine']}; no GPU: `triton.compile` for each target)",
        "",
        f"Switches: {results['switches']}. Cases (precision, head dim): "
        + ", ".join(f"{p} {d}" for p, d in results["cases"])
        + ". Triton versions: "
        + ", ".join(f"{v} ({who})" for v, who in results["versions"].items())
        + f". {len(rows)} of {results['planned']} compilations recorded.",
        "",
        "| target | Triton | compiled | failed | over the shared-memory limit | with spills | atomics | GPU fences "
        "| compile time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for target in results["targets"]:
        for version in versions:
            block = [r for r in rows if r["target"] == target and r["version"] == version]
            if not block:
                continue
            compiled = [r for r in block if r["ok"]]
            over = sum(r["shared"] > limits[target] for r in compiled)
            spilled = sum((r["spill_stores"] or 0) > 0 for r in compiled)
            atomics = sum(r["atomics"] or 0 for r in compiled)
            fences = sum(r["gpu_fences"] or 0 for r in compiled)
            seconds = sum(r["seconds"] or 0 for r in block)
            lines.append(f"| {target} | {version} | {len(compiled)} | {len(block) - len(compiled)} | {over} "
                         f"| {spilled} | {atomics} | {fences} | {seconds:.0f} |")  # fmt: skip
    failed = sorted((r["kernel"], r["config"], r["target"], r["version"], r["error"]) for r in rows if not r["ok"])
    lines += ["", "## Configurations that fail to compile", ""]
    lines += ["| kernel | configuration | target | Triton | error |", "|---|---|---|---|---|"]
    lines += [f"| `{k}` | {c} | {t} | {v} | {e} |" for k, c, t, v, e in dict.fromkeys(failed)] or ["| none | | | | |"]
    for target in results["targets"]:
        lines += ["", f"## {target}: registers / spill stores (bytes) per thread / shared memory (KiB)", ""]
        lines += ["The most over the cases and paths of each precision.", ""]
        lines += ["| kernel | configuration | precision | " + " | ".join(f"Triton {v}" for v in versions) + " |"]
        lines += ["|---|---|---|" + "---|" * len(versions)]
        groups: dict = defaultdict(list)
        for r in rows:
            if r["ok"] and r["target"] == target:
                for precision in sorted({case.split("/")[0] for case in r["cases"]}):
                    groups[r["kernel"], r["config"], precision, r["version"]].append(r)
        for kernel, config, precision in sorted({key[:3] for key in groups}):
            cells = []
            for version in versions:
                group = groups.get((kernel, config, precision, version), [])
                if not group:
                    cells.append("–")
                    continue
                registers = max(r["registers"] or 0 for r in group)
                spills = max(r["spill_stores"] or 0 for r in group)
                shared = max(r["shared"] for r in group)
                cells.append(f"{registers} / {spills} / {shared / 1024:.0f}")
            lines.append(f"| `{kernel}` | {config} | {precision} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict) -> Figure:
    """Left: each kernel's largest spill per thread in bf16, per (target, version). Right: compile times."""
    rows = [dict(zip(results["columns"], row)) for row in results["rows"]]
    figure, (spills, times) = subplots(1, 2, figsize=(14, 5))
    kernels = sorted({r["kernel"] for r in rows})
    blocks = sorted({(r["target"], r["version"]) for r in rows})
    width = 0.8 / max(1, len(blocks))
    for index, (target, version) in enumerate(blocks):
        peak = [
            max((r["spill_stores"] or 0 for r in rows if r["ok"] and (r["target"], r["version"]) == (target, version)
                 and r["kernel"] == kernel and any(c.startswith("bf16/") for c in r["cases"])), default=0)
            for kernel in kernels
        ]  # fmt: skip
        spills.bar([k + index * width for k in range(len(kernels))], peak, width, label=f"{target}, Triton {version}")
    spills.set_xticks([k + 0.4 - width / 2 for k in range(len(kernels))], kernels, rotation=60, ha="right", fontsize=7)
    spills.set_yscale("symlog", linthresh=10)
    spills.set_ylabel("largest spill stores per thread in bf16 (bytes)")
    spills.legend(fontsize=7)
    for target, version in blocks:
        seconds = [r["seconds"] for r in rows if (r["target"], r["version"]) == (target, version) and r["seconds"]]
        times.hist(seconds, bins=30, histtype="step", label=f"{target}, Triton {version} ({len(seconds)} rows)")
    times.set_xlabel("compile time of one kernel configuration (s, one CPU core)")
    times.set_ylabel("compilations")
    times.legend(fontsize=7)
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, "sm_90, the venv's Triton, bf16 at d = 64 and 72 (writes -quick files)",
                              device=False)  # fmt: skip
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--versions", nargs="+", help="Triton versions (default: the pinned ones and the venv's)")
    parser.add_argument("--all-switches", action="store_true", help="all 16 switch combinations, not the released")
    parser.add_argument(
        "--cases", nargs="+", metavar="PRECISION/D", help="cases instead of the default ones, e.g. fp16/72"
    )
    parser.add_argument("--install", action="store_true", help="install the missing Triton versions and stop")
    args = parser.parse_args(argv)
    versions = args.versions or ([venv_version()] if args.quick else [*PINNED, venv_version()])
    if args.install:
        install(versions)
        return
    if args.quick:
        args.targets = ["sm_90"]
    absent = missing_versions(versions)
    if absent:
        parser.error(f"Triton {', '.join(absent)} not installed in {VERSIONS_DIR}: run with --install first")
    discovery = discover(args.all_switches)
    cases = [(c.split("/")[0], int(c.split("/")[1])) for c in args.cases] if args.cases else None
    jobs = plan(discovery, args.targets, versions, cases or (QUICK_CASES if args.quick else CASES))
    rows = read_row_log(ROW_LOG)
    stem = f"{STEM}-quick" if args.quick else STEM
    for target, version in block_order(args.targets, versions):
        compile_jobs([job for job in jobs if job["target"] == target and job["version"] == version], version, rows)
        results = summary(discovery, jobs, rows, versions)  # after each block: a stopped run keeps what it compiled
        save_results(args.out, stem, results, markdown(results), plot)
        block = [job for job in jobs if job["target"] == target and job["version"] == version]
        print(f"{target} Triton {version}: {sum(job['key'] in rows for job in block)} of {len(block)}", flush=True)


if __name__ == "__main__":
    main()
