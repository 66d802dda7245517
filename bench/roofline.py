"""Benchmark: a roofline estimate of one VCA layer against one MHSA layer on the GPUs users train on, from the launch
plan, without a GPU; beside a GPU profile's measured per-kernel times when given one.

Every launch of VCA's Triton core comes from `dit_vca.vca_triton_plan.launch_plan` (the tiles the kernels compile
with on that GPU's target): its unique bytes of global memory, its FLOPs and its programs. The rest of the layer is
estimated the same way from its shapes: the qkv and output projections' GEMMs and their backward (the same in both
layers), VCA's value image and its depthwise 3×3 convolution forward and backward (cuDNN), and MHSA's attention as
PyTorch runs it, FlashAttention-2 (forward; backward's preprocessing with the float32 dq accumulator's zero fill,
main kernel and dq conversion; head dims rounded up to FA2's kernel sizes, 72 to 96).

A launch's estimate: max(bytes / bandwidth, FLOPs / tensor peak) / min(1, programs / multiprocessors), plus
`LAUNCH_FLOOR_US` (a kernel's fixed cost: launch, first wave, tail). Peaks are the vendors' datasheet figures
(`GPUS`, dense tensor-core throughput, no sparsity). A roofline is a floor: no kernel reaches both peaks, and the
model knows nothing of latency within a program, caches or spills; it tells where the bytes and FLOPs are, and
whether the arithmetic allows VCA to match MHSA.

    python -m bench.roofline [--profile PROFILE.json]

PROFILE.json: {"device": "NVIDIA H200", "cases": {"64x256": {"per_head_forward_kernel": 0.051, ...}}}, the
measured milliseconds per call of each kernel (a name the plan uses, or any other: it is listed as measured only)
for cases named BxN; the table then shows them beside the estimates of that device.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench._harness import benchmark_parser, save_results, subplots
from dit_vca.vca_triton_plan import CoreShape, launch_plan

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STEM = "roofline"
LAUNCH_FLOOR_US = 2.0  # a launch's fixed cost (µs): an assumption, typical of the smallest kernels on these GPUs


@dataclass(frozen=True)
class Gpu:
    name: str
    target: str  # the Triton target whose tiles the kernels compile with
    bandwidth: float  # bytes/s of HBM
    tensor_bf16: float  # FLOP/s, dense bf16 tensor cores
    multiprocessors: int
    source: str


# Datasheet figures, dense (the datasheets' bf16 numbers with sparsity are twice these).
GPUS = (
    Gpu("H100 SXM", "sm_90", 3.35e12, 989.4e12, 132, "NVIDIA H100 Tensor Core GPU datasheet (2023): 3.35 TB/s, "
        "1,979 TFLOPS bf16 with sparsity"),
    Gpu("H200 SXM", "sm_90", 4.8e12, 989.4e12, 132, "NVIDIA H200 Tensor Core GPU datasheet (2024): 4.8 TB/s, "
        "1,979 TFLOPS bf16 with sparsity"),
    Gpu("A100 SXM 80GB", "sm_80", 2.039e12, 312e12, 108, "NVIDIA A100 Tensor Core GPU datasheet (2021): "
        "2,039 GB/s, 312 TFLOPS bf16"),
)  # fmt: skip
TRITON = "3.6.0"  # the Triton torch 2.10 and 2.11 pin: the kernels' tiles on these targets
# DiT-XL/2's width at the shapes issue 46 names: (B, N), C = 1152, 16 heads (d = 72), a fixed 8×8 contrast grid.
WIDTH, HEADS, CONTRAST_GRID = 1152, 16, 8
SHAPES = ((64, 256), (32, 256), (1, 1024), (1, 4096), (1, 16384), (1, 65536))
BF16 = 2


@dataclass(frozen=True)
class Work:
    """A launch's work: what it reads and writes (bytes), multiplies (FLOPs) and how many programs run it."""

    name: str
    bytes: int
    flops: int
    programs: int

    def seconds(self, gpu: Gpu) -> float:
        fill = min(1.0, self.programs / gpu.multiprocessors)
        return max(self.bytes / gpu.bandwidth, self.flops / gpu.tensor_bf16) / fill + LAUNCH_FLOOR_US * 1e-6


def vca_core(B: int, N: int, gpu: Gpu) -> tuple[list[Work], list[Work], str]:
    """VCA's Triton core, forward and backward launches, from the plan on this GPU; and the path it takes."""
    H = math.isqrt(N)
    shape = CoreShape(B, N, HEADS, WIDTH // HEADS, H, CONTRAST_GRID, True, True, True, True,
                      multiprocessors=gpu.multiprocessors, platform=(gpu.target, TRITON))  # fmt: skip
    plan = launch_plan(shape)

    def works(launches) -> list[Work]:
        return [Work(w.kernel, w.bytes_read + w.bytes_written, w.flops, w.programs) for w in launches]

    return works(plan.forward), works(plan.backward), plan.path


def gemm(name: str, m: int, n: int, k: int) -> Work:
    """An (m, k) @ (k, n) GEMM in bf16: reads both operands, writes the product, once each."""
    return Work(name, (m * k + k * n + m * n) * BF16, 2 * m * n * k, max(1, (m // 128) * (n // 128)))


def projections(B: int, N: int) -> tuple[list[Work], list[Work]]:
    """The qkv and output projections' GEMMs, forward and backward (each backward: the input's and the weight's
    gradient): the same in both layers."""
    M, C = B * N, WIDTH
    forward = [gemm("qkv GEMM", M, 3 * C, C), gemm("proj GEMM", M, C, C)]
    backward = [gemm("proj dX GEMM", M, C, C), gemm("proj dW GEMM", C, C, M),
                gemm("qkv dX GEMM", M, C, 3 * C), gemm("qkv dW GEMM", 3 * C, C, M)]  # fmt: skip
    return forward, backward


def vca_aten(B: int, N: int) -> tuple[list[Work], list[Work]]:
    """VCA's work besides the core's kernels: v laid out as a channels-last image (a copy), the 3×3 depthwise
    convolution (cuDNN), and its backward (the input's gradient, then the weight's from the image and dY)."""
    image = B * N * WIDTH * BF16
    programs = max(1, B * N * WIDTH // 4096)
    forward = [
        Work("value image", 2 * image, 0, programs),
        Work("depthwise conv", 2 * image, 18 * B * N * WIDTH, programs),
    ]
    backward = [Work("depthwise conv dX", 2 * image, 18 * B * N * WIDTH, programs),
                Work("depthwise conv dW", 2 * image, 18 * B * N * WIDTH, programs)]  # fmt: skip
    return forward, backward


def flash_attention(B: int, N: int) -> tuple[list[Work], list[Work]]:
    """MHSA's attention as PyTorch runs it in bf16: FlashAttention-2, its head dim rounded up to a kernel size (72 to
    96: its products are padded so); its backward's float32 dq accumulator zero-filled, added into by the main
    kernel (counted read and written once) and converted."""
    d = WIDTH // HEADS
    padded = next(size for size in (32, 64, 96, 128, 160, 192, 224, 256) if size >= d)
    G, rows = B * HEADS, B * HEADS * N
    tensor, accumulator, row_floats = rows * d * BF16, rows * padded * 4, rows * 4
    programs = G * math.ceil(N / 128)
    forward = [Work("flash forward", 4 * tensor + row_floats, 4 * G * N * N * padded, programs)]
    backward = [
        Work("flash backward: dO·O, dq zero fill", 2 * tensor + row_floats + accumulator, 0, programs),
        Work("flash backward", 6 * tensor + 2 * row_floats + 2 * accumulator, 10 * G * N * N * padded, programs),
        Work("flash backward: dq conversion", accumulator + tensor, 0, programs),
    ]
    return forward, backward


def estimate(B: int, N: int, gpu: Gpu) -> dict:
    """Both layers' launches at (B, N) on `gpu`, with their estimated times, and the totals."""
    core_forward, core_backward, path = vca_core(B, N, gpu)
    aten_forward, aten_backward = vca_aten(B, N)
    flash_forward, flash_backward = flash_attention(B, N)
    shared_forward, shared_backward = projections(B, N)

    def rows(part: str, works: list[Work]) -> list[dict]:
        return [{"part": part, "launch": w.name, "bytes": w.bytes, "flops": w.flops, "programs": w.programs,
                 "us": round(w.seconds(gpu) * 1e6, 2)} for w in works]  # fmt: skip

    vca = rows("core forward", core_forward) + rows("core backward", core_backward)
    vca += rows("ATen forward", aten_forward) + rows("ATen backward", aten_backward)
    mhsa = rows("forward", flash_forward) + rows("backward", flash_backward)
    shared = rows("forward", shared_forward) + rows("backward", shared_backward)
    attention_vca, attention_mhsa = sum(r["us"] for r in vca), sum(r["us"] for r in mhsa)
    gemms = sum(r["us"] for r in shared)
    return {
        "B": B, "N": N, "gpu": gpu.name, "path": path, "vca": vca, "mhsa": mhsa, "projections": shared,
        "vca_us": round(attention_vca, 1), "mhsa_us": round(attention_mhsa, 1), "projections_us": round(gemms, 1),
        "layer_ratio": round((attention_vca + gemms) / (attention_mhsa + gemms), 3),
        "attention_ratio": round(attention_vca / attention_mhsa, 3),
    }  # fmt: skip


def results(profile: dict | None) -> dict:
    return {
        "benchmark": STEM,
        "date": datetime.date.today().isoformat(),
        "machine": "no GPU: estimates from the launch plan (dit_vca.vca_triton_plan)",
        "gpus": [
            {
                "name": g.name,
                "bandwidth": g.bandwidth,
                "tensor_bf16": g.tensor_bf16,
                "multiprocessors": g.multiprocessors,
                "source": g.source,
            }
            for g in GPUS
        ],  # fmt: skip
        "launch_floor_us": LAUNCH_FLOOR_US,
        "layer": {"width": WIDTH, "heads": HEADS, "contrast_grid": CONTRAST_GRID, "dtype": "bf16", "triton": TRITON},
        "estimates": [estimate(B, N, gpu) for gpu in GPUS for B, N in SHAPES],
        "profile": profile,
    }


def markdown(results: dict) -> str:
    layer = results["layer"]
    lines = [
        f"# Roofline: one layer at C = {layer['width']}, {layer['heads']} heads, a {layer['contrast_grid']}×"
        f"{layer['contrast_grid']} contrast grid, bf16, forward + backward ({results['date']}; {results['machine']})",
        "",
        "Times in µs: max(bytes / bandwidth, FLOPs / tensor peak) per launch, divided by the share of the "
        f"multiprocessors its programs fill, plus {results['launch_floor_us']} µs a launch. Peaks: "
        + "; ".join(
            f"{g['name']} {g['bandwidth'] / 1e12:.2f} TB/s, {g['tensor_bf16'] / 1e12:.0f} TFLOP/s ({g['source']})"
            for g in results["gpus"]
        )  # fmt: skip
        + ". The projections' GEMMs are the same in both layers.",
        "",
        "| GPU | B × N | VCA path | VCA core + conv (µs) | MHSA flash (µs) | attention VCA/MHSA | projections (µs) "
        "| layer VCA/MHSA |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for e in results["estimates"]:
        lines.append(f"| {e['gpu']} | {e['B']} × {e['N']} | {e['path']} | {e['vca_us']} | {e['mhsa_us']} "
                     f"| {e['attention_ratio']} | {e['projections_us']} | {e['layer_ratio']} |")  # fmt: skip
    profile = results["profile"] or {}
    for e in results["estimates"]:
        if e["gpu"] != "H200 SXM" and not (profile and e["gpu"] in profile.get("device", "")):
            continue
        measured = (
            profile.get("cases", {}).get(f"{e['B']}x{e['N']}", {}) if e["gpu"] in profile.get("device", "") else {}
        )
        lines += ["", f"## {e['gpu']}, B × N = {e['B']} × {e['N']}: VCA's launches", ""]
        lines += ["| part | launch | programs | MB | GFLOP | estimate (µs) | measured (µs) |",
                  "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in e["vca"]:
            ms = measured.get(r["launch"])
            shown = "" if ms is None else round(ms * 1e3, 1)
            lines.append(f"| {r['part']} | `{r['launch']}` | {r['programs']} | {r['bytes'] / 1e6:.1f} "
                         f"| {r['flops'] / 1e9:.2f} | {r['us']} | {shown} |")  # fmt: skip
        for name in sorted(set(measured) - {r["launch"] for r in e["vca"]}):
            lines.append(f"| measured only | `{name}` | | | | | {round(measured[name] * 1e3, 1)} |")
    return "\n".join(lines) + "\n"


def plot(results: dict) -> Figure:
    """VCA's layer over MHSA's, estimated, per shape and GPU."""
    figure, axes = subplots(1, 1, figsize=(8, 4.5))
    for gpu in results["gpus"]:
        points = [e for e in results["estimates"] if e["gpu"] == gpu["name"]]
        axes.plot(range(len(points)), [e["layer_ratio"] for e in points], marker="o", label=f"{gpu['name']}: layer")
        axes.plot(range(len(points)), [e["attention_ratio"] for e in points], marker="x", linestyle=":",
                  label=f"{gpu['name']}: attention")  # fmt: skip
    labels = [f"{e['B']}×{e['N']}" for e in results["estimates"] if e["gpu"] == results["gpus"][0]["name"]]
    axes.set_xticks(range(len(labels)), labels)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_xlabel("images × tokens")
    axes.set_ylabel("estimated time, VCA / MHSA (forward + backward)")
    axes.legend(fontsize=7)
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, "(the same: the estimates take a second)", device=False)
    parser.add_argument("--profile", type=Path, help="measured per-kernel milliseconds (see above)")
    args = parser.parse_args(argv)
    profile = json.loads(args.profile.read_text()) if args.profile else None
    result = results(profile)
    save_results(args.out, STEM, result, markdown(result), plot)
    print(markdown(result).split("\n\n## ")[0])


if __name__ == "__main__":
    main()
