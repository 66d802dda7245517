"""Which autotuning configurations of VCA's Triton kernels compile on this GPU with this Triton: the lookup.

Triton's autotuner tries every configuration of a kernel on its first launch and skips only those that run out
of resources; a configuration that does not compile raises, and training stops at its first step (Triton 3.6
failed to compile two of the three configurations of an earlier Stage II backward kernel for sm_100). The compile
matrix (`python -m bench.triton_compile`, docs/benchmarks.md) compiles every kernel in every configuration for
every covered (GPU target, Triton version) without a GPU and writes the failures into `triton_exclusions.json`
beside this module; `dit_vca.vca_triton` builds each kernel's autotuning list through `usable_configs`, which
leaves them out.

A target or version the matrix does not cover keeps every configuration: there a configuration that does not
compile stops the run, unless the first-use check of the Triton core (issue 37, item 2: a compile error or a wrong
result falls back to the ATen core) catches it; `vca_kernel=aten` avoids the Triton core. The table also
records a hash of each kernel's source and of its configuration list; tests/test_triton_compile.py fails when a
kernel changes without a rerun of the matrix.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

TABLE = Path(__file__).with_name("triton_exclusions.json")


def config_name(params: dict[str, int], num_warps: int, num_stages: int) -> str:
    """One configuration's name in the table and in bench/results/triton-compile.*: "BLOCK_M=64 BLOCK_N=64
    warps=4 stages=3"."""
    return " ".join(
        [*(f"{name}={value}" for name, value in params.items()), f"warps={num_warps}", f"stages={num_stages}"]
    )


def gpu_target(capability: tuple[int, int]) -> str:
    """Triton's name of a CUDA compute capability: (9, 0) -> "sm_90"."""
    major, minor = capability
    return f"sm_{major}{minor}"


def current_platform() -> tuple[str | None, str]:
    """(GPU target of the current CUDA device or None without one, the installed Triton's version)."""
    import triton

    target = gpu_target(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    return target, triton.__version__


@functools.cache
def load_table() -> dict:
    """The table the compile matrix wrote (read once per process)."""
    return json.loads(TABLE.read_text())


def excluded_configs(kernel: str, target: str, version: str) -> frozenset[str]:
    """Names of `kernel`'s configurations that failed to compile for (target, version); empty where the table
    has no such entry (an uncovered target or version, or nothing failed)."""
    return frozenset(load_table()["excluded"].get(target, {}).get(version, {}).get(kernel, ()))


def usable_configs(kernel: str, names: tuple[str, ...], configs: list[tuple]) -> list[tuple]:
    """`configs`, (block sizes..., num_warps, num_stages) tuples of `kernel`, without those that failed to compile
    on this (GPU target, Triton version); all of them where no GPU is visible (the compile matrix lists them so)."""
    target, version = current_platform()
    if target is None:
        return configs
    failed = excluded_configs(kernel, target, version)
    return [c for c in configs if config_name(dict(zip(names, c[:-2])), c[-2], c[-1]) not in failed]
