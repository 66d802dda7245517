"""Shared benchmark plumbing: what machine a result came from, whether bf16 is worth timing there, how many
bytes of activations a forward pass saves for backward, which commit of the code produced a result, and saving a
result as JSON, a Markdown table and a PNG plot (each replaced atomically), the JSON and the table stamped with
that commit. matplotlib is imported only to draw: the GPU runbook (bench.gpu) runs where it is not installed."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from atomic_files import atomic_output

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
# What the benchmarks and studies write (and `make bench` rewrites one after another): not part of "the code" whose
# state a result records.
RESULT_FOLDERS = ("bench/results", "studies/results")
COMMIT_VARIABLE = "VCA_COMMIT"  # the commit of a tree that is no git checkout: "<sha>" or "<sha>-dirty"
STAMP_KEY = "measured_on"  # the key of a result's stamp in its JSON (a JSONL file's: in its versions row)
PROBE_SIZE = 512  # a 512³ matmul: large enough to reach a GEMM's speed, small enough for a slow fallback


def allow_recompilations(count: int) -> None:
    """Raises Dynamo's recompilation limit to at least `count`: a benchmark that compiles several instances of one
    forward (models, or blocks keyed apart) has each counted as a recompilation of it. The setting is
    `recompile_limit` in newer torch, `cache_size_limit` in older (the GPU machine's)."""
    config = importlib.import_module("torch._dynamo").config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), count))


def benchmark_parser(doc: str, quick: str, device: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark shares: --quick (`quick` says what the smoke run does), --device and --out."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick)
    if device:
        parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON, table and plot")
    return parser


def describe_device(device: torch.device) -> str:
    """ "NVIDIA H200" or "AMD EPYC, 2 threads": the name that goes into every result file."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    return f"{model}, {torch.get_num_threads()} threads"


def cpu_vector_flags() -> list[str]:
    """The CPU's vector extensions that decide GEMM speed (avx2, avx512f, avx512_bf16, amx_bf16, ...), from
    /proc/cpuinfo: an AVX2-only CPU has no native bf16."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return sorted(flag for flag in flags if flag.startswith(("avx", "amx", "fma")))


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch; a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int = PROBE_SIZE, repeats: int = 5) -> float:
    """GFLOP/s of the fastest of `repeats` size³ matmuls after one warm-up."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def bf16_skip_reason(device: torch.device) -> str | None:
    """Why bf16 rows should be skipped on `device`, or None when bf16 GEMMs are at least half as fast as fp32.

    Without native bf16 instructions (an AVX2-only CPU) bf16 GEMMs fall back to reference code at ~1 % of the
    fp32 speed: timing a model there measures the fallback, and a full benchmark would take hours."""
    fp32, bf16 = matmul_gflops(device, torch.float32), matmul_gflops(device, torch.bfloat16)
    if bf16 >= 0.5 * fp32:
        return None
    return (
        f"bf16 rows skipped: a {PROBE_SIZE}³ bf16 matmul runs at {bf16:.1f} GFLOP/s here against {fp32:.1f} "
        f"in fp32 (no native bf16 GEMM on this device)"
    )


def saved_activation_bytes(forward: Callable[[], object], parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages that autograd saves for backward while `forward()` runs, `parameters`
    excluded (a model's state: its parameters, and its buffers, e.g. RoPE's tables, where it has any): the
    activation memory a training step holds between forward and backward. Counted through saved-tensor hooks,
    so it depends on the code path, not on the machine or the allocator."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()  # kept alive until the count is taken, so no storage is freed and reused
    del output
    return sum(storages.values())


def subplots(rows: int = 1, columns: int = 1, *, figsize: tuple[float, float], **options):
    """(figure, axes) like pyplot.subplots, without pyplot: no display backend is chosen or needed (servers)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=figsize)
    return figure, figure.subplots(rows, columns, **options)


def source_stamp(root: Path = REPO) -> dict:
    """{"commit": the full sha the code was at, "dirty": whether the tree differed from it}, read from git; a tree
    differs when a file outside RESULT_FOLDERS is modified, added, deleted or new and not ignored. A tree that is no
    git checkout (the GPU machine receives a copy of the working tree without .git) takes both from $VCA_COMMIT,
    which the caller sets where git is: `VCA_COMMIT=$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)`.
    Neither: {"commit": None, "dirty": None}, which tests/test_results.py refuses in a committed result."""
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        excluded = [f":(exclude){folder}" for folder in RESULT_FOLDERS]
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", ".", *excluded],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
    given = os.environ.get(COMMIT_VARIABLE, "").strip()
    if given:
        commit, dirty = given.removesuffix("-dirty"), given.endswith("-dirty")
        return {"commit": commit, "dirty": dirty}
    return {"commit": None, "dirty": None}


def stamp_line(stamp: dict) -> str:
    """The sentence a Markdown result ends with: the commit its figures come from, and how that is known."""
    recovered = stamp.get("recovered_from_git_history")
    if recovered is not None and stamp["commit"] is None:
        return f"Commit not recorded when measured and not recoverable from git history: {recovered}."
    if recovered is not None:
        return f"Commit {stamp['commit'][:12]}, recovered from git history (not recorded when measured): {recovered}."
    if stamp.get("commit") is None:
        return f"Commit unknown: measured outside a git checkout without ${COMMIT_VARIABLE}."
    state = "with uncommitted changes" if stamp["dirty"] else "as committed"
    return f"Measured on commit {stamp['commit'][:12]}, the tree {state}."


def stamped_table(table: str, stamp: dict) -> str:
    """`table` followed by its stamp line: what save_results writes as `<stem>.md`."""
    return f"{table.rstrip()}\n\n{stamp_line(stamp)}\n"


def save_results(out_dir: Path, stem: str, results: dict, table: str, plot: Callable[[dict], Figure]) -> None:
    """Write `<stem>.json` (with the commit it was measured on under STAMP_KEY: `source_stamp`), `<stem>.md` (the
    table, ending with that commit) and `<stem>.png` (the figure `plot` draws) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {**results, STAMP_KEY: source_stamp()}
    with atomic_output(out_dir / f"{stem}.json") as path:
        path.write_text(json.dumps(results, indent=1) + "\n")
    with atomic_output(out_dir / f"{stem}.md") as path:
        path.write_text(stamped_table(table, results[STAMP_KEY]))
    figure = plot(results)
    with atomic_output(out_dir / f"{stem}.png") as path:
        figure.savefig(path, format="png", dpi=110)
