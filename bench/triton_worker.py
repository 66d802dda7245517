"""Compiles compile specs (bench.triton_launches) for GPU targets with the Triton this process imports, no GPU needed.

    python -m bench.triton_worker JOBS.json ROWS.jsonl

JOBS.json is a list of jobs (bench.triton_compile.job); one JSON row per job is appended to ROWS.jsonl as soon as it
is compiled, and jobs whose key is there already are skipped (bench.triton_compile starts this process with one
Triton version's folder first on PYTHONPATH, TRITON_INTERPRET unset and no GPU visible; ROWS.jsonl is its row log,
so a run stopped anywhere resumes from the rows written).

Each job is compiled as Triton's JIT would compile that launch on a GPU of the target: its own argument binder
specialises the arguments (pointers aligned to 16 bytes, integers equal to 1 or divisible by 16, as it does at
launch), then `triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32))`,
which runs every stage down to ptxas. Internal API, the same from Triton 3.5 to 3.8: `create_function_from_signature`
and `JITFunction._pack_args` (what `JITFunction.run` calls before it compiles). A row has the error's first line, or
the kernel's shared memory (bytes, from the compiled metadata), registers and spill bytes per thread (ptxas -v, as
TRITON_DUMP_PTXAS_LOG prints it), the atomic instructions of its PTX (`atom.*`, `red.*`), the GPU- or system-scope
memory fences of its SASS (`MEMBAR.*.GPU`, `MEMBAR.*.SYS`: what an acq_rel atomic compiles to on sm_90, with
Triton's own cuobjdump) and the compile time.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, MockTensor, create_function_from_signature

from bench.triton_launches import INTEGER_CLASSES, STALE_SOURCE, source_hash

FLOAT_STAND_IN = 0.5  # non-constexpr floats compile as fp32 whatever their value


def _jit_function(kernel_path: str) -> JITFunction:
    module, name = kernel_path.split(":")
    kernel = getattr(importlib.import_module(module), name)
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def _argument(description: list):
    kind, *value = description
    if kind == "tensor":
        return MockTensor(getattr(torch, value[0]))  # data_ptr() 0: aligned, as PyTorch's allocations are
    if kind == "int":
        return INTEGER_CLASSES[value[0]]
    return FLOAT_STAND_IN if kind == "float" else value[0]


@contextlib.contextmanager
def _native_stderr() -> Iterator[io.BytesIO]:
    """What the compiler's C++ writes to file descriptor 2 meanwhile (MLIR's diagnostics), into the buffer yielded."""
    captured = io.BytesIO()
    with tempfile.TemporaryFile() as file:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(file.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            captured.write(file.read())


def _error_line(error: Exception, diagnostics: str) -> str:
    """The exception's type and first line, with the MLIR pass that failed where the diagnostics name one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = f"{type(error).__name__}: {lines[0] if lines else ''}"
    failed_pass = re.search(r"Pipeline failed while executing \[`(\w+)`", diagnostics)
    return (f"{line} ({failed_pass.group(1)})" if failed_pass else line)[:300]


def _ptxas_figures(log: str) -> dict:
    """Registers and spill-store bytes per thread from ptxas -v's report (the largest, should it list several)."""
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    stores = [int(s) for s in re.findall(r"(\d+) bytes spill stores", log)]
    return {"registers": max(registers, default=None), "spill_stores": max(stores, default=None)}


# An atomic instruction of PTX (`atom.global.add.f32`, `red.global.add.f32`, with or without a predicate), and a
# memory fence of SASS wider than a block (`MEMBAR.ALL.GPU`, `MEMBAR.SC.GPU`, `MEMBAR.SC.SYS`; wgmma's shared-memory
# fences are `MEMBAR.ALL.CTA`).
PTX_ATOMIC = re.compile(r"^\s*(@!?%p\d+\s+)?(atom|red)\.", re.MULTILINE)
SASS_GPU_FENCE = re.compile(r"MEMBAR\.\w+\.(GPU|SYS)")


def compile_job(job: dict) -> dict:
    """The row of one job: its key, then "ok", "error", "shared" (bytes), "registers", "spill_stores" (bytes per
    thread), "atomics", "gpu_fences" and "seconds"."""
    row = {"key": job["key"], "ok": False, "error": None, "shared": None, "registers": None}
    row |= {"spill_stores": None, "atomics": None, "gpu_fences": None, "seconds": None}
    jit = _jit_function(job["kernel"])
    config = job["config"]
    kwargs = {name: _argument(description) for name, description in job["args"].items()} | config["params"]
    kwargs |= {option: config[option] for option in ("num_warps", "num_stages") if config[option] is not None}
    target = GPUTarget("cuda", int(job["target"].removeprefix("sm_")), 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    log, diagnostics = io.StringIO(), io.BytesIO()
    start = time.perf_counter()
    try:
        bound, specialization, options = binder(**kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
        with contextlib.redirect_stdout(log), _native_stderr() as diagnostics:
            compiled = triton.compile(
                ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__
            )
    except Exception as error:  # every compile failure becomes a row: what the matrix is there to find
        row["error"] = _error_line(error, diagnostics.getvalue().decode(errors="replace"))
        row["seconds"] = round(time.perf_counter() - start, 2)
        return row
    row |= {"ok": True, "shared": compiled.metadata.shared, "seconds": round(time.perf_counter() - start, 2)}
    row |= {"atomics": len(PTX_ATOMIC.findall(compiled.asm["ptx"]))}
    with _native_stderr():  # nvdisasm's warnings
        row |= {"gpu_fences": len(SASS_GPU_FENCE.findall(compiled.asm["sass"]))}
    return row | _ptxas_figures(log.getvalue())


def changed_kernels(jobs: list[dict]) -> list[str]:
    """The kernels of `jobs` whose source (as this process imported it) is not the one their launches were recorded
    from. Checked once, as the worker starts: the source is read lazily (linecache), so a check made later, after
    the file was edited, would read the edited lines at the imported line numbers, and a row from a stale
    discovery must not be recorded, let alone as a failure the autotuning lists would then leave out."""
    recorded = {job["kernel"]: job["source"] for job in jobs}
    return sorted(kernel for kernel, source in recorded.items() if source_hash(_jit_function(kernel)) != source)


def main(jobs_file: Path, rows_file: Path) -> None:
    jobs = json.loads(jobs_file.read_text())
    changed = changed_kernels(jobs)
    if changed:
        print(f"error: {', '.join(changed)} changed after their launches were recorded: run the matrix again",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(STALE_SOURCE)
    done = set()
    if rows_file.exists():
        done = {json.loads(line)["key"] for line in rows_file.read_text().splitlines() if line.endswith("}")}
    with rows_file.open("a") as rows:
        for job in jobs:
            if job["key"] in done:
                continue
            print(f"compiling {job['key']}", flush=True)  # the parent tells a crash in a compilation by this line
            rows.write(json.dumps(compile_job(job)) + "\n")
            rows.flush()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
