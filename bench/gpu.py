"""GPU runbook: the speed figures of one CUDA GPU in one command that fits 8 minutes (`make bench-gpu`).

    PYTHONPATH=. python -m bench.gpu                  # bench/results/gpu-cuda.md and gpu-cuda-<time>.jsonl
    PYTHONPATH=. python -m bench.gpu --out /tmp/gpu   # elsewhere
    PYTHONPATH=. python -m bench.gpu --rehearse       # the same code path on the CPU at tiny sizes, < 3 minutes
                                                      # (the Triton kernels under Triton's interpreter)

It runs with the machine's own interpreter and never the package index (docs/benchmarks.md says which wheels to copy
in beside the tree). Three parts, each in its own process under its own time budget, the slowest last:
1. attention: one layer, C = 384 and 1152, bf16 and fp32, batch·N = 16384: first a check that every SDPA call
   of VCA's ATen core runs with only the flash kernel allowed; then VCA's core on the Triton kernels
   (dit_vca.vca_triton, the CUDA default) against the ATen core and MHSA on SDPA (flash in bf16), n = 64,
   N = 256 … 16384, fwd and fwd+bwd (the goal rows: bf16 fwd+bwd, Triton ≤ 1.0x flash MHSA at N = 256 and
   ≤ 0.33x at N = 16384); then, fwd+bwd at N = 1024, 4096, 16384, the ATen core with Stage II as SDPA calls
   and as GEMMs against MHSA;
2. samplers: DDIM-50 (DiT-S/2) and Euler-50 (SiT-S/2), VCA and MHSA, bf16, batch 32;
3. train: the DiT-S/2 training step at 256 and 512 px, batch 32, fp32 and bf16 (the goal rows), at 256 px in
   bf16 with model.recipe=lightning-qknorm (RMSNorm, SwiGLU, QK-norm, RoPE), then compiled (inductor) at 256 px
   in bf16, compile time apart from the steady state; then DiT-XL/2 at 256 px,
   bf16, eager and compiled (the goal row: compiled VCA ≥ 0.95x MHSA's images/s). VCA's core runs on the
   Triton kernels there (the CUDA default).
Every case appends its row to the JSONL file the moment it is measured, so a part stopped by its budget or by
running out of memory keeps what it measured (an out-of-memory case is a row with its error). After each part
the summary table (gpu-<device>.md) is rewritten: each part's status, every row, and met/missed for every goal
row, fp32 and bf16.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from atomic_files import write_text_atomic
from bench._harness import RESULTS, bf16_skip_reason, describe_device, saved_activation_bytes, synchronize

RUNBOOK_SECONDS = 480  # the whole run on one H200-class GPU
MAIN_PROCESS_SECONDS = 30  # this process's own start-up and summaries, outside the parts' budgets
LARGE_MODEL = "DiT-XL/2"
LARGE_MODEL_GOAL = 0.95  # compiled bf16 DiT-XL/2-VCA training: at least 0.95x MHSA's images/s
ATTENTION_GOAL = 1 / 3  # fwd+bwd at the largest N, n = 64: VCA at least 3x faster than flash MHSA
# The Triton core's goals, VCA layer / flash MHSA time (bf16, fwd+bwd, n = 64), per token count.
TRITON_GOALS = {256: 1.0, 16384: 1 / 3}


@dataclass(frozen=True)
class Settings:
    """The sizes of one run: the GPU runbook's, or the rehearsal's (tiny, on the CPU)."""

    budgets: dict[str, int]  # part -> seconds, in the order the parts run (the slowest last)
    attention_tokens: tuple[int, ...]
    attention_widths: tuple[tuple[int, int], ...]  # (C, heads)
    tokens_per_batch: int
    triton_tokens: tuple[int, ...]  # the Triton core against the ATen core and flash MHSA
    triton_tokens_per_batch: int
    triton_modes: tuple[str, ...]  # "fwd", "fwd+bwd"
    large_model: bool  # DiT-XL/2 training steps too (bf16, eager and compiled)
    min_time: float  # seconds of timed calls per attention row
    sampler_batch: int
    sampler_steps: int
    sampler_latent_side: int
    sampler_depth: int | None  # None: the model's own depth
    model_overrides: tuple[str, ...]  # config overrides for the training models
    train_batch: int
    train_warmup: int
    train_steps: int
    threads: int | None = None  # torch.set_num_threads in each part (None: torch's default)


RUNBOOK = Settings(
    budgets={"attention": 180, "samplers": 45, "train": 225},
    attention_tokens=(1024, 4096, 16384),
    attention_widths=((384, 6), (1152, 16)),
    tokens_per_batch=16384,
    triton_tokens=(256, 1024, 4096, 16384),
    triton_tokens_per_batch=16384,
    triton_modes=("fwd", "fwd+bwd"),
    large_model=True,
    min_time=0.2,
    sampler_batch=32,
    sampler_steps=50,
    sampler_latent_side=32,
    sampler_depth=None,
    model_overrides=(),
    train_batch=32,
    train_warmup=3,
    train_steps=10,
)
REHEARSAL = Settings(
    budgets={"attention": 40, "samplers": 25, "train": 85},
    attention_tokens=(64, 256),
    attention_widths=((64, 2),),
    tokens_per_batch=256,
    triton_tokens=(64,),  # under Triton's interpreter: one image, one mode
    triton_tokens_per_batch=64,
    triton_modes=("fwd+bwd",),
    large_model=False,
    min_time=0.0,
    sampler_batch=2,
    sampler_steps=3,
    sampler_latent_side=8,
    sampler_depth=1,
    model_overrides=("model.depth=1", "model.hidden_size=64", "model.num_heads=2"),
    train_batch=1,
    train_warmup=1,
    train_steps=1,
    threads=1,
)  # tiny kernels: no thread waits
# By construction: the parts' budgets and this process fit the runbook's 8 minutes.
assert sum(RUNBOOK.budgets.values()) + MAIN_PROCESS_SECONDS <= RUNBOOK_SECONDS


# ----------------------------------------------------------------------------------------------------------------
# The parts: their cases, in order, and how one case is measured (in the part's own process)
# ----------------------------------------------------------------------------------------------------------------


def attention_rows(settings: Settings, device: torch.device, dtypes: list[str]) -> Iterator[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.attention import build_layer, interleaved_median_seconds, layer_step

    # Flash only: a VCA call the flash kernel rejects raises instead of falling back to the math kernel.
    tokens, (width, heads) = settings.attention_tokens[0], settings.attention_widths[0]
    layer = build_layer("vca-64", width, heads, tokens).to(device)
    layer.kernel = "aten"  # the Triton core calls no SDPA
    x = torch.randn(max(1, settings.tokens_per_batch // tokens), tokens, width, device=device, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for stage2_sdpa in (True, False):
            layer.stage2_sdpa = stage2_sdpa
            layer_step(layer, x, torch.bfloat16, backward=True)()
    yield {"case": "flash-only", "tokens": tokens, "width": width, "result": "every VCA SDPA call ran on flash"}
    yield from triton_layer_rows(settings, device, dtypes)

    for tokens in settings.attention_tokens:  # the largest (slowest) last
        batch = max(1, settings.tokens_per_batch // tokens)
        for width, heads in settings.attention_widths:
            for dtype in dtypes:
                torch.manual_seed(0)
                layers = {
                    "mhsa-sdpa": build_layer("mhsa-sdpa", width, heads, tokens),
                    "vca-64": build_layer("vca-64", width, heads, tokens),
                }
                layers["vca-64-gemm2"] = build_layer("vca-64", width, heads, tokens)
                layers["vca-64"].stage2_sdpa, layers["vca-64-gemm2"].stage2_sdpa = True, False
                layers["vca-64"].kernel = layers["vca-64-gemm2"].kernel = "aten"  # the Triton core: triton_layer_rows
                layers = {name: layer.to(device) for name, layer in layers.items()}
                x = torch.randn(batch, tokens, width, device=device, requires_grad=True)
                torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
                steps = {name: layer_step(layer, x, torch_dtype, backward=True) for name, layer in layers.items()}
                seconds = interleaved_median_seconds(steps, device, settings.min_time, 20)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
                    saved = {
                        name: saved_activation_bytes(lambda layer=layer, x=x: layer(x), layer.parameters()) / 2**20
                        for name, layer in layers.items()
                    }
                yield {
                    "case": "layer",
                    "tokens": tokens,
                    "width": width,
                    "heads": heads,
                    "batch": batch,
                    "dtype": dtype,
                    "mode": "fwd+bwd",
                    "ms": {name: 1e3 * s for name, s in seconds.items()},
                    "saved_mib": saved,
                }
                del layers, steps


def triton_layer_rows(settings: Settings, device: torch.device, dtypes: list[str]) -> Iterator[dict]:
    """VCA's core on the Triton kernels against the ATen core (Stage II as SDPA calls) and flash MHSA: one layer,
    n = 64, forward and forward + backward. bf16 first (the goal rows), then by head dimension, then N: the
    kernels compile (autotuning) in the warm-up of the first row of each dtype and head dimension, and every
    later N reuses them."""
    from bench.attention import build_layer, interleaved_median_seconds, layer_step

    for dtype, (width, heads), tokens in itertools.product(
        reversed(dtypes), settings.attention_widths, settings.triton_tokens
    ):
        batch = max(1, settings.triton_tokens_per_batch // tokens)
        torch.manual_seed(0)
        layers = {name: build_layer(name, width, heads, tokens) for name in ("mhsa-sdpa", "vca-64")}
        layers["vca-64-triton"] = build_layer("vca-64", width, heads, tokens)
        layers["vca-64"].kernel, layers["vca-64-triton"].kernel = "aten", "triton"
        layers = {name: layer.to(device) for name, layer in layers.items()}
        x = torch.randn(batch, tokens, width, device=device, requires_grad=True)
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        for mode in settings.triton_modes:
            steps = {name: layer_step(layer, x, torch_dtype, mode == "fwd+bwd") for name, layer in layers.items()}
            seconds = interleaved_median_seconds(steps, device, settings.min_time, 20)
            yield {
                "case": "triton-layer",
                "tokens": tokens,
                "width": width,
                "heads": heads,
                "batch": batch,
                "dtype": dtype,
                "mode": mode,
                "ms": {name: 1e3 * s for name, s in seconds.items()},
            }
        del layers, steps


def sampler_rows(settings: Settings, device: torch.device, dtypes: list[str]) -> Iterator[dict]:
    from bench.samplers import build, time_sampler

    model_settings = {
        "batch": settings.sampler_batch,
        "input_size": settings.sampler_latent_side,
        "depth": settings.sampler_depth,
        "step_divisor": 1,
    }
    for name, sampler in (("DiT-S/2", "ddim"), ("SiT-S/2", "euler")):
        for attention in ("mhsa", "vca"):
            model, objective = build(name, attention, model_settings, device)
            for dtype in dtypes[-1:]:  # bf16 where it is native, else fp32
                seconds, result = time_sampler(
                    model, objective, sampler, settings.sampler_steps, settings.sampler_batch, dtype, device
                )
                yield {
                    "case": "sampler",
                    "model": f"{name}-{attention.upper()}",
                    "name": name,
                    "attention": attention,
                    "sampler": f"{sampler}-{settings.sampler_steps}",
                    "precision": dtype,
                    "nfe": result.nfe,
                    "seconds": seconds,
                    "images_per_s": settings.sampler_batch / seconds,
                    "ms_per_nfe": 1e3 * seconds / result.nfe,
                }


def train_rows(settings: Settings, device: torch.device, dtypes: list[str]) -> Iterator[dict]:
    from bench.train import Case, goal_cases, measure

    cases = [case for dtype in dtypes for case in goal_cases(dtype)]  # the goal rows, fp32 and bf16
    cases += [  # LightningDiT's block options, QK-norm and RoPE inside VCA's core (Triton)
        Case("DiT-S/2", 256, attention, None, dtypes[-1], "latents", options="lightning-qknorm")
        for attention in ("mhsa", "vca")
    ]
    cases += [
        replace(case, compiled=True)
        for case in goal_cases(dtypes[-1])
        if case.image_size == 256 and case.contrast_grid is None
    ]  # compiling is the slowest: last
    cases = [(case, []) for case in cases]
    if settings.large_model:  # same step, the DiT-XL/2 model (its VCA core on the Triton kernels on CUDA)
        cases += [
            (Case(LARGE_MODEL, 256, attention, None, "bf16", "latents", compiled), [f"model.name={LARGE_MODEL}"])
            for compiled in (False, True)
            for attention in ("mhsa", "vca")
        ]
    for case, overrides in cases:
        yield {
            "case": "train",
            **measure(
                case,
                settings.train_batch,
                settings.train_warmup,
                settings.train_steps,
                [*settings.model_overrides, *overrides],
                count_memory=True,
            ),
        }


PART_ROWS: dict[str, Callable[[Settings, torch.device, list[str]], Iterator[dict]]] = {
    "attention": attention_rows,
    "samplers": sampler_rows,
    "train": train_rows,
}


def append_row(path: Path, row: dict) -> None:
    """Append one JSON line and push it to disk, so that a process killed afterwards keeps it."""
    with open(path, "a") as file:
        file.write(json.dumps(row) + "\n")
        file.flush()
        os.fsync(file.fileno())


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSONL file; a last line cut short by a killed writer is left out."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def run_part_here(part: str, settings: Settings, rows_path: Path) -> None:
    """Measure every case of `part` in this process, appending each row as it is done. A case that runs out of
    GPU memory ends the part with a row that says so (the rows before it stay)."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = ["fp32"] if bf16_skip_reason(device) else ["fp32", "bf16"]
    rows = PART_ROWS[part](settings, device, dtypes)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except torch.cuda.OutOfMemoryError as error:
            append_row(rows_path, {"part": part, "error": f"out of memory: {str(error).splitlines()[0]}"})
            torch.cuda.empty_cache()
            return
        append_row(rows_path, {"part": part, **row})
        print(f"bench.gpu {part}: {json.dumps(row)[:200]}", flush=True)
        synchronize(device)


def run_part(part: str, budget: int, rehearse: bool, rows_path: Path) -> dict:
    """`python -m bench.gpu --part PART` in its own process, stopped after `budget` seconds."""
    command = [
        sys.executable,
        "-m",
        "bench.gpu",
        "--part",
        part,
        "--rows",
        str(rows_path),
        *(["--rehearse"] if rehearse else []),
    ]
    print(f"bench.gpu: part {part} (budget {budget} s)", flush=True)
    # A rehearsal stays on the CPU, where the Triton kernels run under Triton's interpreter.
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"} if rehearse else {})}
    started = time.perf_counter()
    try:
        done = subprocess.run(command, timeout=budget, env=env)
        status = "ok" if done.returncode == 0 else f"failed (exit status {done.returncode})"
    except subprocess.TimeoutExpired:
        status = f"stopped after its budget of {budget} s"
    return {"status": status, "seconds": round(time.perf_counter() - started, 1)}


# ----------------------------------------------------------------------------------------------------------------
# The summary
# ----------------------------------------------------------------------------------------------------------------


def verdict(ratio: float, limit: float) -> str:
    return "met" if ratio <= limit else f"missed by {ratio / limit:.2f}x"


def summary_lines(rows: list[dict], goal_tokens: int) -> list[str]:
    """Markdown tables of the rows, with met/missed for every goal row (attention at `goal_tokens`, every
    precision; the training goals, fp32 and bf16, eager and compiled)."""
    from bench.train import goal_verdicts, vca_speedups

    lines = []
    errors = [r for r in rows if "error" in r]
    lines += [f"- {r['part']}: {r['error']}" for r in errors]
    checks = [r for r in rows if r.get("case") == "flash-only"]
    lines += [f"- flash-only check (N = {r['tokens']}, C = {r['width']}, bf16, fwd+bwd): {r['result']}" for r in checks]
    layers = [r for r in rows if r.get("case") == "layer"]
    if layers:
        lines += [
            "",
            "| N | C / h | dtype | MHSA SDPA ms | VCA n=64 ms | VCA n=64, Stage II GEMMs ms | VCA / MHSA "
            "| VCA (GEMMs) / MHSA | saved MiB MHSA / VCA |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in layers:
            ms, saved = r["ms"], r["saved_mib"]
            ratio = ms["vca-64"] / ms["mhsa-sdpa"]
            goal = (
                f" (goal ≤ {ATTENTION_GOAL:.2f}: {verdict(ratio, ATTENTION_GOAL)})"
                if r["tokens"] == goal_tokens
                else ""
            )
            lines.append(
                f"| {r['tokens']} | {r['width']} / {r['heads']} | {r['dtype']} | {ms['mhsa-sdpa']:.2f} "
                f"| {ms['vca-64']:.2f} | {ms['vca-64-gemm2']:.2f} | {ratio:.3f}{goal} "
                f"| {ms['vca-64-gemm2'] / ms['mhsa-sdpa']:.3f} | {saved['mhsa-sdpa']:.0f} / "
                f"{saved['vca-64']:.0f} |"
            )
    lines += triton_summary_lines([r for r in rows if r.get("case") == "triton-layer"])
    samplers = [r for r in rows if r.get("case") == "sampler"]
    if samplers:
        lines += ["", "| model | sampler | precision | NFE | images/s | ms / NFE |", "|---|---|---|---:|---:|---:|"]
        lines += [
            f"| {r['model']} | {r['sampler']} | {r['precision']} | {r['nfe']} | {r['images_per_s']:.1f} "
            f"| {r['ms_per_nfe']:.2f} |"
            for r in samplers
        ]
    results = [r for r in rows if r.get("case") == "train"]
    if results:
        speedups = {s["label"]: s for s in vca_speedups(results)}
        lines += [
            "",
            "| case | images/s | VCA / MHSA time | saved MiB | peak GiB | compile s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in results:
            ratio = f"{speedups[r['label']]['time_ratio']:.2f}" if r["label"] in speedups else ""
            peak = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else ""
            compiled = f"{r['compile_seconds']:.1f}" if r["compile_seconds"] is not None else ""
            lines.append(
                f"| {r['label']} | {r['images_per_s']:.1f} | {ratio} | {r['saved_mib']:.0f} | {peak} | {compiled} |"
            )
        lines += ["", "Goals (VCA / MHSA time per training step):"]
        lines += [
            f"- {v['label']}: {v['ratio']:.2f} (goal ≤ {v['limit']:.2f}, {v['verdict']})"
            for v in goal_verdicts(list(speedups.values()))
        ]
        large = speedups.get(f"{LARGE_MODEL} 256px vca bf16 latents compiled")
        if large:
            ratio = large["speedup_over_mhsa"]
            large_verdict = "met" if ratio >= LARGE_MODEL_GOAL else f"missed by {LARGE_MODEL_GOAL / ratio:.2f}x"
            lines.append(
                f"- {LARGE_MODEL} 256px vca bf16 latents compiled: {ratio:.2f}x MHSA's images/s "
                f"(goal ≥ {LARGE_MODEL_GOAL:.2f}, {large_verdict})"
            )
    return lines


def triton_summary_lines(rows: list[dict]) -> list[str]:
    """The Triton core's table, with met/missed for the TRITON_GOALS rows (bf16, fwd+bwd)."""
    if not rows:
        return []
    lines = [
        "",
        "| N | C / h | dtype | pass | MHSA flash ms | VCA ATen ms | VCA Triton ms | Triton / MHSA | Triton / ATen |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = r["ms"]
        ratio = ms["vca-64-triton"] / ms["mhsa-sdpa"]
        goal = ""
        if r["tokens"] in TRITON_GOALS and r["dtype"] == "bf16" and r["mode"] == "fwd+bwd":
            limit = TRITON_GOALS[r["tokens"]]
            goal = f" (goal ≤ {limit:.2f}: {verdict(ratio, limit)})"
        lines.append(
            f"| {r['tokens']} | {r['width']} / {r['heads']} | {r['dtype']} | {r['mode']} | {ms['mhsa-sdpa']:.2f} "
            f"| {ms['vca-64']:.2f} | {ms['vca-64-triton']:.2f} | {ratio:.3f}{goal} "
            f"| {ms['vca-64-triton'] / ms['vca-64']:.3f} |"
        )
    return lines


def write_summary(path: Path, title: str, statuses: dict[str, dict], rows: list[dict], goal_tokens: int) -> str:
    lines = [
        title,
        "",
        "| part | status | seconds |",
        "|---|---|---:|",
        *(f"| {name} | {s['status']} | {s['seconds']} |" for name, s in statuses.items()),
        "",
        *summary_lines(rows, goal_tokens),
    ]
    text = "\n".join(lines) + "\n"
    write_text_atomic(path, text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="the same code path on the CPU at tiny sizes")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSONL rows and the summary")
    parser.add_argument("--part", choices=sorted(PART_ROWS), help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = REHEARSAL if args.rehearse else RUNBOOK
    if args.part:
        run_part_here(args.part, settings, args.rows)
        return
    if not torch.cuda.is_available() and not args.rehearse:
        print(
            "error: bench.gpu: no CUDA GPU here; the CPU figures come from `make bench` "
            "(or rehearse this runbook with --rehearse)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    device = torch.device("cpu" if args.rehearse else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-{device.type}{'-rehearsal' if args.rehearse else ''}"
    rows_path = args.out / f"{stem}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.jsonl"
    rehearsal = " (rehearsal: tiny sizes, the numbers mean nothing)" if args.rehearse else ""
    title = (
        f"GPU runbook on {describe_device(device)}{rehearsal}; torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}; rows in {rows_path.name}"
    )
    statuses: dict[str, dict] = {}
    for part, budget in settings.budgets.items():
        statuses[part] = run_part(part, budget, args.rehearse, rows_path)
        text = write_summary(
            args.out / f"{stem}.md", title, statuses, read_rows(rows_path), settings.attention_tokens[-1]
        )
    print(text)


if __name__ == "__main__":
    main()
