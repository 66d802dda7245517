"""Benchmark: one Visual-Contrast Attention layer against multi-head self-attention, time versus token count.

For every token count N, width C / heads h, dtype and pass (forward, forward+backward) it times MHSA on SDPA,
MHSA as plain bmm–softmax–bmm (faster than the CPU SDPA kernel in bf16), VCA with n = 64 and n = N/4 contrast
tokens, VCA's readable reference path with n = 64 (the implementation before the fused kernel) and VCA with
n = 64 whose Stage II runs as SDPA calls instead of the device's default (GEMMs on the CPU), and compares VCA
with the faster MHSA. The methods of one row are timed interleaved (one call of each in turn,
medians over the rounds), so a machine shared with other jobs slows them alike. Whole layers are timed, q/k/v
and output projections included, since that is what a model swaps. bf16 runs under autocast, as training does.
A large matmul timed in the same run gives the machine's peak, so each row also says which fraction of it the
layer reaches (FLOPs counted by torch's FlopCounterMode). Forward+backward rows also give the activation memory
each layer saves for backward (saved-tensor hooks: a count, independent of the machine).

With --options it times LightningDiT's block options that enter the attention instead: MHSA on SDPA and VCA
(n = 64) plain, with QK-norm, with 2-D RoPE and with both (the attention of the preset lightning-qknorm; VCA
applies them inside its fused core), and VCA's readable path with both (the options as autograd operations around
the attention); per option set VCA's ratio to MHSA, each option's cost over the plain layer, and the activations
saved for backward.

Writes bench/results/attention-<device>[-options][-quick].{json,md,png}. On the CPU run it as `make bench` does,
with MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000: glibc's default allocator maps every large tensor
afresh and the first-touch page faults distort timings by up to 2×.

Usage: python -m bench.attention [--quick] [--options] [--device cpu|cuda] [--threads T] [--cpu-time]
                                 [--tokens N ...] [--widths C ...] [--out bench/results]
"""

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from bench._harness import (
    benchmark_parser,
    bf16_skip_reason,
    cpu_vector_flags,
    describe_device,
    save_results,
    saved_activation_bytes,
    subplots,
    synchronize,
)
from dit_vca.attention import MultiHeadSelfAttention, VCAOptions, VisualContrastAttention

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTHS = ((384, 6), (1152, 16))  # DiT-S and DiT-XL: (C, heads)
FIXED_CONTRAST = 64  # n = 64, an 8×8 contrast grid
METHODS = ("mhsa-sdpa", "mhsa-bmm", "vca-64", "vca-N/4", "vca-64-readable", "vca-64-sdpa2")
# --options: the block options QK-norm and RoPE, alone and together, as suffixes of a method's name.
OPTION_SETS = ("", "+qknorm", "+rope", "+qknorm+rope")
OPTION_METHODS = (
    *(f"mhsa-sdpa{options}" for options in OPTION_SETS),
    *(f"vca-64{options}" for options in OPTION_SETS),
    "vca-64-readable+qknorm+rope",
)
MEMORY_GOALS = {256: 1.0, 1024: 0.5, 4096: 0.5}  # VCA / MHSA saved activations: ≤ at N = 256, well below beyond
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ALLOCATOR_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")


class MatmulSelfAttention(MultiHeadSelfAttention):
    """The MHSA baseline with its attention written as bmm–softmax–bmm instead of SDPA."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, h, N, N)
        return scores.softmax(dim=-1) @ v  # (B, h, N, d)


class ReadableVCA(VisualContrastAttention):
    """VCA through its readable reference path (autograd over torch operations), as before the fused kernel."""

    def forward(self, x: Tensor) -> Tensor:
        return self.reference_forward(x)


def build_layer(method: str, width: int, heads: int, tokens: int) -> nn.Module:
    """The layer a method names: a base name (METHODS), then "+qknorm" and "+rope" for the block options."""
    grid = int(tokens**0.5)
    method, *options = method.split("+")
    qk_norm, rope = "qknorm" in options, "rope" in options
    if method == "mhsa-sdpa":
        return MultiHeadSelfAttention(width, heads, qk_norm=qk_norm, rope_grid=grid if rope else None)
    if method == "mhsa-bmm":
        return MatmulSelfAttention(width, heads, qk_norm=qk_norm, rope_grid=grid if rope else None)
    contrast_grid = None if method == "vca-N/4" else 8  # None: H/2, n = N/4
    layer_class = ReadableVCA if method == "vca-64-readable" else VisualContrastAttention
    options = VCAOptions(contrast_grid=contrast_grid)
    layer = layer_class(width, heads, grid, block_index=0, options=options, qk_norm=qk_norm, rope=rope)
    if method == "vca-64-sdpa2":  # Stage II as SDPA calls; the other VCA rows use the device's default
        layer.stage2_sdpa = True
    return layer


def median_seconds(step, device: torch.device, min_time: float, max_repeats: int) -> float:
    """Median wall time of `step` after one warm-up call, repeated until min_time has passed (≥ 3 times)."""
    return interleaved_median_seconds({"step": step}, device, min_time, max_repeats)["step"]


def interleaved_median_seconds(
    steps: dict, device: torch.device, min_time: float, max_repeats: int, clock: Callable[[], float] = time.perf_counter
) -> dict:
    """Median time of each of `steps` (name -> callable) after one warm-up call each, timed in rounds of one
    call of every step, until the slowest has run for min_time (≥ 3 rounds, ≤ max_repeats). `clock`: wall time,
    or time.process_time (CPU time of this process: what other jobs on the machine do not change)."""
    for step in steps.values():
        step()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    while (rounds := len(next(iter(times.values())))) < 3 or (
        max(sum(t) for t in times.values()) < min_time and rounds < max_repeats
    ):
        for name, step in steps.items():
            start = clock()
            step()
            synchronize(device)
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def layer_step(layer: nn.Module, x: Tensor, dtype: torch.dtype, backward: bool):
    """One forward (and backward) pass of `layer` on x, under autocast for bf16."""
    autocast = torch.autocast(x.device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        with autocast, torch.set_grad_enabled(backward):  # a forward-only pass is inference: no graph
            out = layer(x)
        if backward:
            out.backward(torch.ones_like(out))

    return step


def saved_mib(layer: nn.Module, x: Tensor, dtype: torch.dtype, recompute_qkv: bool = False) -> float:
    """MiB of activations that one forward pass of `layer` on x saves for backward (VCA: `recompute_qkv` set)."""
    if isinstance(layer, VisualContrastAttention):
        layer.recompute_qkv = recompute_qkv
    autocast = torch.autocast(x.device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    with autocast:
        saved = saved_activation_bytes(lambda: layer(x), [*layer.parameters(), *layer.buffers()])
    if isinstance(layer, VisualContrastAttention):
        layer.recompute_qkv = False
    return saved / 2**20


def count_flops(method: str, width: int, heads: int, tokens: int, batch: int, backward: bool) -> int:
    """FLOPs of one pass, counted on the meta device (shapes only) with the math SDPA backend."""
    with torch.device("meta"):
        layer = build_layer(method, width, heads, tokens)
        x = torch.empty(batch, tokens, width, requires_grad=backward)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            layer_step(layer, x, torch.float32, backward)()
    return counter.get_total_flops()


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, min_time: float) -> dict[str, float]:
    """GFLOP/s of a size³ matmul through torch.mm and, on the CPU, a 1×1 convolution (oneDNN's GEMM, which
    outruns MKL's fp32 GEMM on some CPUs); the larger one is the peak."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    flops = 2 * size**3
    rates = {"mm": flops / median_seconds(lambda: torch.mm(a, b), device, min_time, 20) / 1e9}
    if device.type == "cpu":
        image, kernel = a.T.reshape(1, size, size, 1), b.T.reshape(size, size, 1, 1)  # (1, K, M, 1), (N, K, 1, 1)
        conv = lambda: torch.nn.functional.conv2d(image, kernel)  # noqa: E731
        rates["conv1x1"] = flops / median_seconds(conv, device, min_time, 20) / 1e9
    rates["peak"] = max(rates.values())
    return rates


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    token_counts = args.tokens or (
        [256, 1024] if args.quick else [256, 1024, 4096] + ([16384] if device.type == "cuda" else [])
    )
    widths = [w for w in WIDTHS if w[0] in args.widths] if args.widths else WIDTHS[:1] if args.quick else WIDTHS
    min_time = 0.0 if args.quick else 0.5  # quick: warm-up + 3 calls
    tokens_per_batch = args.tokens_per_batch or (1024 if args.quick else 4096 if device.type == "cpu" else 16384)
    matmul_size = 512 if args.quick else 2048 if device.type == "cpu" else 8192
    dtypes, notes = dict(DTYPES), []
    skip_bf16 = bf16_skip_reason(device)
    if skip_bf16:
        del dtypes["bf16"]
        notes.append(skip_bf16)
    peak = {name: matmul_peak(device, dtype, matmul_size, min_time) for name, dtype in dtypes.items()}
    print(f"matmul GFLOP/s: {json.dumps(peak)}", flush=True)

    rows = []
    for tokens in token_counts:
        batch = max(1, tokens_per_batch // tokens)
        for width, heads in widths:
            for dtype_name, dtype in dtypes.items():
                for backward in (False, True):
                    methods = list(OPTION_METHODS) if args.options else METHODS
                    methods = [m for m in methods if not (m == "vca-N/4" and tokens // 4 == FIXED_CONTRAST)]
                    torch.manual_seed(0)
                    layers = {m: build_layer(m, width, heads, tokens).to(device) for m in methods}
                    x = torch.randn(batch, tokens, width, device=device, requires_grad=backward)
                    steps = {m: layer_step(layer, x, dtype, backward) for m, layer in layers.items()}
                    clock = time.process_time if args.cpu_time else time.perf_counter
                    seconds = interleaved_median_seconds(steps, device, min_time, 20, clock)
                    for method in methods:
                        flops = count_flops(method, width, heads, tokens, batch, backward)
                        row = dict(
                            tokens=tokens,
                            width=width,
                            heads=heads,
                            batch=batch,
                            dtype=dtype_name,
                            mode="fwd+bwd" if backward else "fwd",
                            method=method,
                            ms=1e3 * seconds[method],
                            gflop=flops / 1e9,
                            peak_fraction=flops / seconds[method] / 1e9 / peak[dtype_name]["peak"],
                        )
                        if backward:
                            row["saved_mib"] = saved_mib(layers[method], x, dtype)
                            if method == "vca-64":
                                row["saved_mib_recompute_qkv"] = saved_mib(layers[method], x, dtype, True)
                        rows.append(row)
                        print(
                            f"N={tokens:5d} C={width:4d} {dtype_name} {row['mode']:7s} {method:27s} "
                            f"{row['ms']:9.2f} ms  {100 * row['peak_fraction']:5.1f}% of peak",
                            flush=True,
                        )
                    del layers, steps, x
    return dict(
        device=describe_device(device),
        device_type=device.type,
        torch=torch.__version__,
        quick=args.quick,
        options=args.options,
        cpu_flags=cpu_vector_flags(),
        allocator={name: os.environ.get(name) for name in ALLOCATOR_ENV},
        tokens_per_batch=tokens_per_batch,
        matmul_gflops=peak,
        notes=notes,
        rows=rows,
    )


def grouped_rows(results: dict) -> list[tuple[dict, dict]]:
    """The rows by (N, C, dtype, pass): (that case's tokens, width, heads, dtype and mode, its rows by method)."""
    groups: dict[tuple, tuple[dict, dict]] = {}
    for row in results["rows"]:
        case = {key: row[key] for key in ("tokens", "width", "heads", "dtype", "mode")}
        groups.setdefault(tuple(case.values()), (case, {}))[1][row["method"]] = row
    return list(groups.values())


def comparisons(results: dict) -> list[dict]:
    """One entry per (N, C, dtype, pass): the times of every method, VCA's ratio to the faster MHSA and, for
    forward+backward, the activations each saves for backward."""
    table = []
    for case, by_method in grouped_rows(results):
        by_method.setdefault("vca-N/4", by_method["vca-64"])
        mhsa = min((by_method["mhsa-sdpa"], by_method["mhsa-bmm"]), key=lambda row: row["ms"])
        entry = dict(
            **case,
            ms={method: row["ms"] for method, row in by_method.items()},
            mhsa_best=mhsa["method"],
            mhsa_peak_fraction=mhsa["peak_fraction"],
            vca64_peak_fraction=by_method["vca-64"]["peak_fraction"],
            ratio_64=by_method["vca-64"]["ms"] / mhsa["ms"],
            ratio_quarter=by_method["vca-N/4"]["ms"] / mhsa["ms"],
            ratio_readable=by_method["vca-64-readable"]["ms"] / mhsa["ms"],
            ratio_sdpa2=by_method["vca-64-sdpa2"]["ms"] / mhsa["ms"],
        )
        if case["mode"] == "fwd+bwd":
            entry["saved_mib"] = {method: row["saved_mib"] for method, row in by_method.items()}
            entry["saved_mib_vca64_recompute_qkv"] = by_method["vca-64"]["saved_mib_recompute_qkv"]
        table.append(entry)
    return table


def option_comparisons(results: dict) -> list[dict]:
    """--options: one entry per (N, C, dtype, pass): the times of every method; per option set VCA's ratio to MHSA
    with the same options; each layer's time over its plain layer's (the options' cost); for forward+backward
    the activations saved for backward."""
    table = []
    for case, by_method in grouped_rows(results):
        ms = {method: row["ms"] for method, row in by_method.items()}
        entry = dict(
            **case,
            ms=ms,
            ratio={options: ms[f"vca-64{options}"] / ms[f"mhsa-sdpa{options}"] for options in OPTION_SETS},
            over_plain={
                method: ms[method] / ms[method.split("+")[0].removesuffix("-readable")] for method in OPTION_METHODS
            },
        )
        if case["mode"] == "fwd+bwd":
            entry["saved_mib"] = {method: row["saved_mib"] for method, row in by_method.items()}
        table.append(entry)
    return table


def option_markdown(results: dict, table: list[dict]) -> str:
    lines = [
        f"Attention layer with the block options on {results['device']} "
        f"({' '.join(results['cpu_flags']) or 'no AVX'}; torch {results['torch']}, {results['tokens_per_batch']} "
        f"tokens per batch, allocator env {results['allocator']}).",
        f"Times in ms ({results['clock']}, median of interleaved rounds) of MHSA on SDPA and VCA with n = 64, each "
        "plain / with QK-norm / with RoPE / with both (both: the attention of model.blocks=lightning-qknorm; VCA "
        "applies them inside its fused core); readable = VCA's readable path with both (the options as autograd "
        "operations); ratio = VCA / MHSA with the same options; cost = time with both / the plain layer's; saved "
        "= MiB of activations saved for backward with both (MHSA / VCA / VCA readable; plain VCA in brackets).",
        "",
        "| N | C / h | dtype | pass | MHSA ms | VCA ms | VCA readable ms | VCA / MHSA | cost of both, MHSA / VCA "
        "| saved MiB |",
        "|---:|---:|---|---|---|---|---:|---|---|---|",
    ]
    both = OPTION_SETS[-1]
    for e in table:
        ms, over = e["ms"], e["over_plain"]
        saved = ""
        if "saved_mib" in e:
            mib = e["saved_mib"]
            saved = " / ".join(f"{mib[m]:.0f}" for m in (f"mhsa-sdpa{both}", f"vca-64{both}", f"vca-64-readable{both}"))
            saved += f" ({mib['vca-64']:.0f})"
        mhsa, vca = (
            " / ".join(f"{ms[base + options]:.2f}" for options in OPTION_SETS) for base in ("mhsa-sdpa", "vca-64")
        )
        ratios = " / ".join(f"{e['ratio'][options]:.2f}" for options in OPTION_SETS)
        lines.append(
            f"| {e['tokens']} | {e['width']} / {e['heads']} | {e['dtype']} | {e['mode']} | {mhsa} | {vca} "
            f"| {ms['vca-64-readable' + both]:.2f} | {ratios} | {over['mhsa-sdpa' + both]:.2f} / "
            f"{over['vca-64' + both]:.2f} | {saved} |"
        )
    lines += [""] + [f"Note: {note}." for note in results["notes"]] if results["notes"] else []
    return "\n".join(lines) + "\n"


def goal_lines(table: list[dict], device_type: str) -> list[str]:
    """The issue's goals (fwd+bwd, n = 64): ratio ≤ 1 at N = 256 and ≤ 0.2 at N = 4096 on the CPU, ≤ 1/3 at
    N = 16384 on a GPU; saved activations of VCA ≤ MHSA's (SDPA) at N = 256 and ≤ half of them from N = 1024."""
    goals = {256: 1.0, 4096: 0.2} if device_type == "cpu" else {16384: 1 / 3}
    lines = []
    for entry in table:
        if entry["mode"] != "fwd+bwd":
            continue
        limit = goals.get(entry["tokens"])
        if limit is not None:
            lines.append(
                f"- time, N = {entry['tokens']}, C = {entry['width']}, {entry['dtype']}: VCA/MHSA = "
                f"{entry['ratio_64']:.2f} (goal ≤ {limit:.2f}, {verdict(entry['ratio_64'], limit)}; "
                f"readable VCA path {entry['ratio_readable']:.2f})"
            )
        limit = MEMORY_GOALS.get(entry["tokens"])
        if limit is not None:
            mhsa, saved = entry["saved_mib"]["mhsa-sdpa"], entry["saved_mib"]
            lean, fused = entry["saved_mib_vca64_recompute_qkv"] / mhsa, saved["vca-64"] / mhsa
            lines.append(
                f"- saved activations, N = {entry['tokens']}, C = {entry['width']}: VCA/MHSA = "
                f"{fused:.2f} (goal ≤ {limit:.2f}, {verdict(fused, limit)}; "
                f"with recompute_qkv {lean:.2f}, {verdict(lean, limit)}; readable VCA path "
                f"{saved['vca-64-readable'] / mhsa:.2f})"
            )
    return lines


def verdict(ratio: float, limit: float) -> str:
    return "met" if ratio <= limit else f"missed by {ratio / limit:.2f}×"


def markdown(results: dict, table: list[dict]) -> str:
    peaks = ", ".join(f"{name} {rates['peak']:.0f}" for name, rates in results["matmul_gflops"].items())
    lines = [
        f"Attention layer benchmark on {results['device']} ({' '.join(results['cpu_flags']) or 'no AVX'}; "
        f"torch {results['torch']}, {results['tokens_per_batch']} tokens per batch, allocator env "
        f"{results['allocator']}).",
        f"Times in ms ({results['clock']}, median of interleaved rounds); ratio = VCA / faster MHSA; "
        f"readable = VCA's reference path (n = 64); SDPA II = VCA (n = 64) with Stage II as SDPA calls; % peak = "
        f"layer GFLOP/s over a large matmul's ({peaks} GFLOP/s); saved = MiB of activations saved for backward "
        f"(MHSA SDPA / VCA n=64 / VCA readable).",
        "",
        "| N | C / h | dtype | pass | MHSA SDPA | MHSA bmm | VCA n=64 | VCA n=N/4 | VCA readable | VCA n=64 SDPA II "
        "| VCA64/MHSA | VCA(N/4)/MHSA | readable/MHSA | SDPA II/MHSA | % peak MHSA | % peak VCA64 | saved MiB |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for e in table:
        ms = e["ms"]
        saved = (
            " / ".join(f"{e['saved_mib'][m]:.0f}" for m in ("mhsa-sdpa", "vca-64", "vca-64-readable"))
            if "saved_mib" in e
            else ""
        )
        lines.append(
            f"| {e['tokens']} | {e['width']} / {e['heads']} | {e['dtype']} | {e['mode']} | {ms['mhsa-sdpa']:.2f} "
            f"| {ms['mhsa-bmm']:.2f} | {ms['vca-64']:.2f} | {ms['vca-N/4']:.2f} | {ms['vca-64-readable']:.2f} "
            f"| {ms['vca-64-sdpa2']:.2f} | **{e['ratio_64']:.2f}** | {e['ratio_quarter']:.2f} "
            f"| {e['ratio_readable']:.2f} | {e['ratio_sdpa2']:.2f} "
            f"| {100 * e['mhsa_peak_fraction']:.0f} | {100 * e['vca64_peak_fraction']:.0f} | {saved} |"
        )
    lines += [""] + [f"Note: {note}." for note in results["notes"]] if results["notes"] else []
    goals = goal_lines(table, results["device_type"])
    return "\n".join(lines + ([""] + ["Goals (forward+backward, n = 64):"] + goals if goals else [])) + "\n"


def plot(results: dict) -> "Figure":
    widths = sorted({(row["width"], row["heads"]) for row in results["rows"]})
    dtypes = [name for name in DTYPES if name in results["matmul_gflops"]]
    fig, axes = subplots(len(widths), len(dtypes), figsize=(5 * len(dtypes), 4 * len(widths)), squeeze=False)
    for (width, heads), ax_row in zip(widths, axes):
        for dtype, ax in zip(dtypes, ax_row):
            for method in dict.fromkeys(row["method"] for row in results["rows"]):
                points = sorted(
                    (r["tokens"], r["ms"])
                    for r in results["rows"]
                    if r["method"] == method and r["width"] == width and r["dtype"] == dtype and r["mode"] == "fwd+bwd"
                )
                if points:
                    ax.plot(*zip(*points), marker="o", label=method)
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="tokens N",
                ylabel=f"fwd+bwd ms (batch·N = {results['tokens_per_batch']})",
                title=f"C = {width}, h = {heads}, {dtype}",
            )
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.suptitle(f"VCA vs MHSA, one layer, {results['device']}")
    fig.tight_layout()
    return fig


def main() -> None:
    parser = benchmark_parser(__doc__, quick="N ≤ 1024, C = 384, small batches, 3 repeats: a smoke run")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads for the run (default: torch's)"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time instead of wall time (CPU, --threads 1 only): "
        "insensitive to other jobs on a shared machine",
    )
    parser.add_argument(
        "--options",
        action="store_true",
        help="time the block options QK-norm and RoPE (MHSA and VCA, alone and together) instead of the methods",
    )
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts N (squares; default 256 1024 4096)")
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        choices=[w for w, _ in WIDTHS],
        help="widths C to run (default all; 384 with --quick)",
    )
    parser.add_argument(
        "--tokens-per-batch",
        type=int,
        default=None,
        help="batch = max(1, this // N); default 4096 on the CPU, 16384 on a GPU, 1024 with --quick",
    )
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    for tokens in args.tokens or []:
        if int(tokens**0.5) ** 2 != tokens or tokens < 16:
            parser.error(f"--tokens {tokens}: expected a square token count ≥ 16 (an H×H grid)")

    if args.cpu_time and (args.device != "cpu" or args.threads != 1):
        parser.error("--cpu-time needs --device cpu --threads 1 (CPU time of several threads is not a duration)")
    results = {**run(args), "clock": "cpu time" if args.cpu_time else "wall time"}
    table = (option_comparisons if args.options else comparisons)(results)
    results["comparisons"] = table
    text = (option_markdown if args.options else markdown)(results, table)
    suffix = (
        ("-options" if args.options else "") + ("-quick" if args.quick else "") + ("-cputime" if args.cpu_time else "")
    )
    stem = f"attention-{torch.device(args.device).type}{suffix}"
    save_results(args.out, stem, results, text, plot)
    print(text)
    print(f"wrote {args.out / stem}.{{json,md,png}}")


if __name__ == "__main__":
    main()
