"""The second GPU runbook: the rows that do not decide the Triton core, for a second lent GPU (≤ 560 s, one command).

    python3 -m bench.gpu_extended --out "$OUT"            # on the GPU machine, from the repository root
    python3 -m bench.gpu_extended --rehearse --out /tmp/g  # the same code on the CPU at tiny sizes (the suite runs it)

Rows and summary as bench.gpu writes them (<out>/gpu-extended-<device>-<time>.jsonl, <out>/gpu-extended-<device>.md),
each part in its own process under its budget, the slowest last:
1. part `attention`: a check that every SDPA call of VCA's ATen core runs with only the flash kernel allowed; the
   Triton core against the ATen core and flash MHSA at the rows bench.gpu leaves out (C = 384 and 1152, bf16 and fp32,
   N = 256 … 16384, forward and forward + backward); then, fwd+bwd at N = 1024, 4096, 16384, the ATen core with
   Stage II as SDPA calls and as GEMMs against MHSA (goal at the largest N: ≤ 1/3 of flash MHSA);
2. part `samplers`: DDIM-50 (DiT-S/2) and Euler-50 (SiT-S/2), VCA and MHSA, bf16, batch 32;
3. part `train`: the DiT-S/2 training step at 256 and 512 px (and a fixed 8×8 contrast grid at 512), batch 32,
   fp32 and bf16 (the goals of bench.gpu_training.TIME_GOALS), at 256 px in bf16 with model.blocks=lightning-qknorm
   (RMSNorm, SwiGLU, QK-norm, RoPE; VCA applies the last two inside its core), then compiled at 256 px in bf16.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from bench._harness import bf16_skip_reason, saved_activation_bytes
from bench.gpu import CONTRAST_GRID, RUNBOOK_SECONDS, XL_WIDTH, Runbook, main, training_rows, triton_layer_rows
from bench.gpu_training import TrainingCase, goal_cases


@dataclass(frozen=True)
class Sizes:
    """The sizes of this runbook: on the GPU, or in the rehearsal (tiny, on the CPU)."""

    attention_tokens: tuple[int, ...]
    attention_widths: tuple[tuple[int, int], ...]  # (C, heads)
    tokens_per_batch: int
    triton_tokens: tuple[int, ...]
    triton_contrast_grid: int  # p of the Triton rows (n = p²)
    triton_modes: tuple[str, ...]  # "fwd", "fwd+bwd"
    min_time: float  # seconds of timed calls per attention row
    sampler_batch: int
    sampler_steps: int
    sampler_latent_side: int
    sampler_depth: int | None  # None: the model's own depth
    train_sizes: dict[str, int] | None  # depth, hidden_size, num_heads overrides (the rehearsal's tiny models)
    train_image_sizes: tuple[int, ...] | None  # None: the goals' (256 and 512 px)
    train_batch: int
    train_warmup: int
    train_steps: int
    compile_backend: str
    precisions: tuple[str, ...] | None = None  # None: fp32, and bf16 where bf16 GEMMs are native
    threads: int | None = None


def precisions(sizes: Sizes, device: torch.device) -> list[str]:
    """fp32, and bf16 where bf16 GEMMs are native (or the rehearsal's own)."""
    if sizes.precisions is not None:
        return list(sizes.precisions)
    return ["fp32"] if bf16_skip_reason(device) else ["fp32", "bf16"]


def attention_rows(sizes: Sizes, device: torch.device) -> Iterator[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.attention import build_layer, interleaved_median_seconds, layer_step

    # Flash only: a VCA call the flash kernel rejects raises instead of falling back to the math kernel.
    tokens, (width, heads) = sizes.attention_tokens[0], sizes.attention_widths[0]
    layer = build_layer("vca-64", width, heads, tokens).to(device)
    layer.kernel = "aten"  # the Triton core calls no SDPA
    x = torch.randn(max(1, sizes.tokens_per_batch // tokens), tokens, width, device=device, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for stage2_sdpa in (True, False):
            layer.stage2_sdpa = stage2_sdpa
            layer_step(layer, x, torch.bfloat16, backward=True)()
    yield {"case": "flash-only", "tokens": tokens, "width": width, "result": "every VCA SDPA call ran on flash"}

    dtypes = precisions(sizes, device)
    goal_rows = {("bf16", XL_WIDTH)}  # bench.gpu's
    cases = [
        (dtype, width, tokens)
        for dtype, width, tokens in itertools.product(reversed(dtypes), sizes.attention_widths, sizes.triton_tokens)
        if (dtype, width) not in goal_rows or device.type != "cuda"
    ]
    yield from triton_layer_rows(
        device, cases, sizes.triton_modes, sizes.tokens_per_batch, sizes.min_time, sizes.triton_contrast_grid
    )

    for tokens in sizes.attention_tokens:  # the largest (slowest) last
        batch = max(1, sizes.tokens_per_batch // tokens)
        for (width, heads), dtype in itertools.product(sizes.attention_widths, dtypes):
            torch.manual_seed(0)
            layers = {
                "mhsa-sdpa": build_layer("mhsa-sdpa", width, heads, tokens),
                "vca-64": build_layer("vca-64", width, heads, tokens),
                "vca-64-gemm2": build_layer("vca-64", width, heads, tokens),
            }
            layers["vca-64"].stage2_sdpa, layers["vca-64-gemm2"].stage2_sdpa = True, False
            layers["vca-64"].kernel = layers["vca-64-gemm2"].kernel = "aten"  # the Triton core: triton_layer_rows
            layers = {name: layer.to(device) for name, layer in layers.items()}
            x = torch.randn(batch, tokens, width, device=device, requires_grad=True)
            torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
            steps = {name: layer_step(layer, x, torch_dtype, backward=True) for name, layer in layers.items()}
            seconds = interleaved_median_seconds(steps, device, sizes.min_time, 20)
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


def sampler_rows(sizes: Sizes, device: torch.device) -> Iterator[dict]:
    from bench.samplers import build, time_sampler

    model_settings = {
        "batch": sizes.sampler_batch,
        "input_size": sizes.sampler_latent_side,
        "depth": sizes.sampler_depth,
        "step_divisor": 1,
    }
    for name, sampler in (("DiT-S/2", "ddim"), ("SiT-S/2", "euler")):
        for attention in ("mhsa", "vca"):
            model, objective = build(name, attention, model_settings, device)
            dtype = precisions(sizes, device)[-1]  # bf16 where it is native, else fp32
            seconds, result = time_sampler(
                model, objective, sampler, sizes.sampler_steps, sizes.sampler_batch, dtype, device
            )
            yield {
                "case": "sampler",
                "model": f"{name}-{attention.upper()}",
                "name": name,
                "attention": attention,
                "sampler": f"{sampler}-{sizes.sampler_steps}",
                "precision": dtype,
                "nfe": result.nfe,
                "seconds": seconds,
                "images_per_s": sizes.sampler_batch / seconds,
                "ms_per_nfe": 1e3 * seconds / result.nfe,
            }


def train_rows(sizes: Sizes, device: torch.device) -> Iterator[dict]:
    dtypes = precisions(sizes, device)
    cases = [case for dtype in dtypes for case in goal_cases(dtype)]  # the goal rows, fp32 and bf16
    cases += [  # LightningDiT's block options
        TrainingCase("DiT-S/2", 256, attention, dtypes[-1], recipe="lightning-qknorm") for attention in ("mhsa", "vca")
    ]
    cases += [
        replace(case, compiled=True)
        for case in goal_cases(dtypes[-1])
        if case.image_size == 256 and case.contrast_grid is None
    ]  # compiling is the slowest: last
    if sizes.train_image_sizes is not None:  # the rehearsal's tiny images
        image_size = dict(zip(sorted({case.image_size for case in cases}), sizes.train_image_sizes))
        cases = [replace(case, image_size=image_size[case.image_size]) for case in cases]
    yield from training_rows(cases, sizes)


EXTENDED = Runbook(
    module="bench.gpu_extended",
    doc=__doc__,
    stem="gpu-extended",
    parts={"attention": attention_rows, "samplers": sampler_rows, "train": train_rows},
    budgets={"attention": 230, "samplers": 60, "train": 250},
    rehearsal_budgets={"attention": 150, "samplers": 120, "train": 200},  # room for a loaded CI machine
    settings=Sizes(
        attention_tokens=(1024, 4096, 16384),
        attention_widths=((384, 6), XL_WIDTH),
        tokens_per_batch=16384,
        triton_tokens=(256, 1024, 4096, 16384),
        triton_contrast_grid=CONTRAST_GRID,
        triton_modes=("fwd", "fwd+bwd"),
        min_time=0.2,
        sampler_batch=32,
        sampler_steps=50,
        sampler_latent_side=32,
        sampler_depth=None,
        train_sizes=None,
        train_image_sizes=None,
        train_batch=32,
        train_warmup=3,
        train_steps=10,
        compile_backend="inductor",
    ),
    rehearsal=Sizes(
        attention_tokens=(64,),
        attention_widths=((64, 2),),
        tokens_per_batch=64,
        triton_tokens=(16,),  # under Triton's interpreter: 4×4 tokens, n = 4, one mode
        triton_contrast_grid=2,
        triton_modes=("fwd+bwd",),
        min_time=0.0,
        sampler_batch=2,
        sampler_steps=3,
        sampler_latent_side=8,
        sampler_depth=1,
        train_sizes={"depth": 1, "hidden_size": 64, "num_heads": 2},
        train_image_sizes=(64, 128),  # token grids 4 and 8 (the fixed 8×8 contrast grid needs 8)
        train_batch=1,
        train_warmup=1,
        train_steps=1,
        compile_backend="aot_eager",
        precisions=("fp32",),  # bench.gpu's rehearsal runs bf16
        threads=1,
    ),
)
assert EXTENDED.budget_seconds(rehearse=False) <= RUNBOOK_SECONDS

if __name__ == "__main__":
    main(runbook=EXTENDED)
