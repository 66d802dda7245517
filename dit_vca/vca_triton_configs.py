"""The tile configurations of VCA's Triton kernels, each declared with the platforms where it must not run.

Every kernel has an ordered list of configurations (block sizes, warps, pipeline stages); on a given platform (GPU
target, Triton version) and case (precision, head dimension) a launch takes the first configuration that no
exclusion rules out. Nothing is autotuned: the block sizes decide the launch grids, so the launch plan
(dit_vca.vca_triton_plan) knows every grid, loop trip, byte and product before anything runs, and a process never
compiles a configuration it will not use. An exclusion sits beside the configuration it concerns, with the reason
the compile matrix found (`python -m bench.triton_compile`, docs/triton-compile.md): a compile error, spills, more
shared memory than the target has. tests/test_triton_compile.py checks each exclusion against the matrix's
recorded results and that every covered case keeps a configuration that compiled there within the target's shared
memory (and, where the project promises it, without spills).

Under Triton's interpreter every kernel runs its `interpreted` configuration: blocks of 16 (tl.dot's smallest),
so that the tests' small shapes cross tile boundaries.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRETER = "interpreter"  # the platform's target under Triton's interpreter
# The product precisions a case names: the dtype the core computes in, and for float32 whether the products run on
# TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32) or in IEEE float32.
PRECISIONS = ("bf16", "fp16", "tf32", "ieee")


@dataclass(frozen=True)
class Exclusion:
    """Where a configuration must not run: every (target, Triton version, precision, head dim) it names (an empty
    tuple names all), and why (what the compile matrix recorded there)."""

    why: str
    targets: tuple[str, ...] = ()
    versions: tuple[str, ...] = ()
    precisions: tuple[str, ...] = ()
    head_dims: tuple[int, ...] = ()

    def applies(self, target: str | None, version: str, precision: str, head_dim: int) -> bool:
        return all(
            not allowed or value in allowed
            for value, allowed in (
                (target, self.targets),
                (version, self.versions),
                (precision, self.precisions),
                (head_dim, self.head_dims),
            )
        )


@dataclass(frozen=True)
class TileConfig:
    """One configuration of a kernel: its block sizes (constexpr arguments), warps and pipeline stages, where it must
    not run, and the spill stores per thread (bytes) it is allowed on sm_90 in bf16 at d = 64 and 72 (the compile
    matrix's record of ptxas's report; 0 unless declared with the reason)."""

    blocks: dict[str, int]
    num_warps: int
    num_stages: int
    excluded: tuple[Exclusion, ...] = field(default=())
    spills: int = 0
    spills_why: str = ""

    @property
    def name(self) -> str:
        """ "BLOCK_M=64 BLOCK_N=32 warps=8 stages=2": how the compile matrix's results name it."""
        blocks = [f"{name}={value}" for name, value in self.blocks.items()]
        return " ".join([*blocks, f"warps={self.num_warps}", f"stages={self.num_stages}"])

    def launch_options(self) -> dict[str, int]:
        return {**self.blocks, "num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class KernelConfigs:
    """A kernel's configurations in order of preference, and the one it runs under the interpreter."""

    compiled: tuple[TileConfig, ...]
    interpreted: TileConfig

    def choose(self, platform: tuple[str | None, str], precision: str, head_dim: int) -> TileConfig:
        """The first configuration no exclusion rules out on `platform` (GPU target, INTERPRETER or None for no GPU;
        Triton version) for this case; the interpreter's under the interpreter."""
        if platform[0] == INTERPRETER:
            return self.interpreted
        for config in self.compiled:
            if not any(e.applies(*platform, precision, head_dim) for e in config.excluded):
                return config
        raise RuntimeError(f"no configuration of this kernel is left for {platform}, {precision}, d = {head_dim}")


def _config(blocks: dict[str, int], warps: int, stages: int, *excluded: Exclusion, spills: tuple[int, str] = (0, ""),
            ) -> TileConfig:  # fmt: skip
    return TileConfig(blocks, warps, stages, excluded, *spills)


def _interpreted(**blocks: int) -> TileConfig:
    return TileConfig(blocks, 4, 1)


# The declarations. BLOCK_C: contrast tokens per block (the per-head kernels hold all of a head's, so theirs is a
# bound: n ≤ BLOCK_C); BLOCK_M, BLOCK_N: FlashAttention's query and key rows (Stage I's queries are the contrast
# tokens, so its kernels have BLOCK_C and BLOCK_N; Stage II's keys are the contrast tokens: BLOCK_M and BLOCK_C);
# BLOCK_T: tokens per trip of the pooling kernels; BLOCK_R, BLOCK_W: rows (images) and columns per trip of the sum of
# dE±'s partials, BLOCK_P: rows per trip of the sums of the parameters' partials.
# Chosen from the compile matrix (docs/triton-compile.md): registers and spills on sm_90 in bf16 at d = 64 and 72,
# shared memory on sm_80 in float32 at d = 128.
# The kernels whose loops over tiles call a tile's work as a function of its own (CALLS=1, see
# dit_vca.vca_triton_tiles.inlined_and_called) have the same configuration inlined (CALLS=0) for sm_100, where a
# called function with a tensor-core product does not compile.
_NO_CALLS_ON_SM100 = Exclusion("PassManager::run failed (ConvertNVGPUToLLVM): a called function with a product",
                               targets=("sm_100",))  # fmt: skip
# What a configuration spills on sm_90 in bf16 at d = 64 and 72, the most over Triton 3.5.1, 3.6.0 and 3.8.0
# (docs/triton-compile.md has the experiments): a tile's inner loop over blocks of contrast tokens (Triton hoists its
# loop-invariant index tensors), and in the per-head backward the arguments its calls keep alive; Triton 3.5.1 spills
# the most. Every configuration tried that spilled less spilled more elsewhere or gave up 64-row tensor-core tiles.
_LOOP = "the inner loop over contrast blocks of a tile, the least over the tiles tried"
CONFIGS: dict[str, KernelConfigs] = {
    "per_head_forward_kernel": KernelConfigs(
        (
            _config(
                dict(BLOCK_C=64, BLOCK_N=64, BLOCK_M=64),
                8,
                2,
                Exclusion(
                    "256 KiB of shared memory, over sm_90's 227 KiB",
                    targets=("sm_90",),
                    precisions=("tf32", "ieee"),
                    head_dims=(128,),
                ),
                Exclusion(
                    "380-388 bytes of spills a thread (mma.sync's tiles)",
                    targets=("sm_80",),
                    versions=("3.5.1", "3.6.0"),
                    precisions=("bf16", "fp16"),
                ),
            ),
            _config(dict(BLOCK_C=64, BLOCK_N=32, BLOCK_M=32), 4, 1),
        ),
        _interpreted(BLOCK_C=64, BLOCK_N=16, BLOCK_M=16),
    ),  # fmt: skip
    "per_head_backward_kernel": KernelConfigs(
        (
            _config(
                dict(BLOCK_C=16, BLOCK_N=64, BLOCK_M=64, BLOCK_T=64, CALLS=1),
                8,
                1,
                _NO_CALLS_ON_SM100,
                spills=(120, "one call per image and per tile keeps their arguments alive across the calls"),
            ),
            _config(dict(BLOCK_C=16, BLOCK_N=64, BLOCK_M=64, BLOCK_T=64, CALLS=0), 8, 1),
        ),
        _interpreted(BLOCK_C=16, BLOCK_N=16, BLOCK_M=16, BLOCK_T=16, CALLS=1),
    ),  # fmt: skip
    "sum_partials_kernel": KernelConfigs(
        (_config(dict(BLOCK_R=16, BLOCK_W=256, BLOCK_P=32), 4, 1),), _interpreted(BLOCK_R=16, BLOCK_W=64, BLOCK_P=16)
    ),
    "pool_kernel": KernelConfigs((_config(dict(BLOCK_T=64), 4, 1),), _interpreted(BLOCK_T=16)),
    "stage1_partial_forward_kernel": KernelConfigs(
        (
            _config(dict(BLOCK_C=64, BLOCK_N=64, CALLS=1), 8, 2, _NO_CALLS_ON_SM100),
            _config(dict(BLOCK_C=64, BLOCK_N=64, CALLS=0), 8, 2),
        ),
        _interpreted(BLOCK_C=16, BLOCK_N=16, CALLS=1),
    ),
    "stage1_combine_kernel": KernelConfigs((_config({}, 4, 1),), _interpreted()),
    "stage2_forward_kernel": KernelConfigs(
        (_config(dict(BLOCK_M=64, BLOCK_C=64), 4, 2, spills=(8, "Triton 3.5.1 alone")),),
        _interpreted(BLOCK_M=16, BLOCK_C=16),
    ),
    "stage2_backward_kernel": KernelConfigs(
        (
            _config(dict(BLOCK_M=64, BLOCK_C=16, CALLS=1), 4, 1, _NO_CALLS_ON_SM100, spills=(152, _LOOP)),
            _config(dict(BLOCK_M=64, BLOCK_C=16, CALLS=0), 4, 1),
        ),
        _interpreted(BLOCK_M=16, BLOCK_C=16, CALLS=1),
    ),
    "stage1_norm_backward_kernel": KernelConfigs((_config({}, 4, 1),), _interpreted()),
    "stage1_backward_kernel": KernelConfigs(
        (
            _config(dict(BLOCK_C=32, BLOCK_N=64, CALLS=1), 8, 1, _NO_CALLS_ON_SM100, spills=(48, _LOOP)),
            _config(dict(BLOCK_C=32, BLOCK_N=64, CALLS=0), 8, 1),
        ),
        _interpreted(BLOCK_C=16, BLOCK_N=16, CALLS=1),
    ),
    "streams_backward_kernel": KernelConfigs((_config({}, 4, 1),), _interpreted()),
    "pool_backward_kernel": KernelConfigs((_config(dict(BLOCK_T=64), 4, 1),), _interpreted(BLOCK_T=16)),
}


def gpu_target(capability: tuple[int, int]) -> str:
    """Triton's name of a CUDA compute capability: (9, 0) -> "sm_90"."""
    major, minor = capability
    return f"sm_{major}{minor}"


@functools.cache
def current_platform() -> tuple[str | None, str]:
    """(INTERPRETER under Triton's interpreter, else the GPU target of the current CUDA device or None without one;
    the installed Triton's version)."""
    import torch
    import triton

    if INTERPRETED:
        return INTERPRETER, triton.__version__
    target = gpu_target(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    return target, triton.__version__
