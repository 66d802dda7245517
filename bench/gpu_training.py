"""The training step the GPU runbooks time (bench.gpu, bench.gpu_extended), built without the config system.

The GPU machine has torch, timm and accelerate but neither omegaconf (training.config) nor diffusers, so the runbooks
cannot build `training.loop.Trainer`. This step is the Trainer's for one process (what `Trainer.optimizer_step`
runs under Accelerate with the experiment configs, which set `train.max_grad_norm: null`): the model under autocast
in the precision's dtype, the objective's loss on random latents and labels, backward, fused AdamW (on CUDA, as
training.build creates it), and the float32 EMA update (timm's ModelEmaV3, as training.ema configures it). No data
loading or gradient norm: neither depends on the attention. `compiled` wraps the model as `train.compile=true`
does: `model.compile(fullgraph=True)` (or, `per_block`, each block: what Inductor compiles once for all blocks,
in a fraction of the time); `graphed` runs the step as train.cuda_graph does, captured in a CUDA graph and
replayed (generation.cuda_graphs; the optimiser capturable, the EMA update eager after each replay).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench._harness import allow_recompilations, synchronize
from dit_vca.attention import VCAOptions, VisualContrastAttention, set_vca_kernel
from dit_vca.model_spec import ModelSpec, model_family
from dit_vca.models import create_backbone
from generation.cuda_graphs import WARMUP_CALLS, CapturedCalls
from generation.objective_builder import create_objective, default_objective

LATENT_CHANNELS, DOWNSAMPLING = 4, 8  # the SD VAE's latents (generation.vae.SD_VAE_ARCHITECTURE)
FIXED_GRID = 8
# The goals, VCA / MHSA time per training step (DiT-S/2, fp32, from latents): (image size, grid) -> limit.
TIME_GOALS = {(256, None): 1.00, (512, None): 0.90, (512, FIXED_GRID): 0.67}
LARGE_MODEL = "DiT-XL/2"
LARGE_MODEL_GOAL = 0.95  # compiled bf16 DiT-XL/2-VCA training: at least 0.95x MHSA's images/s


@dataclass(frozen=True)
class TrainingCase:
    model: str  # "DiT-XL/2", "DiT-S/2", ...
    image_size: int  # pixels; latents are image_size / 8
    attention: str  # "mhsa" or "vca"
    precision: str  # "fp32" or "bf16"
    compiled: bool = False
    contrast_grid: int | None = None  # VCA's p; None: H/2
    recipe: str = "dit"  # the block options' preset, model.blocks (dit_vca.model_options.BLOCK_PRESETS); "recipe" in
    # the results, as they were first written
    graphed: bool = False  # the step captured in a CUDA graph and replayed (train.cuda_graph)
    per_block: bool = False  # compiled: each block (fullgraph), not the whole model

    @property
    def label(self) -> str:
        grid = f" grid {self.contrast_grid}" if self.contrast_grid else ""
        recipe = f" {self.recipe}" if self.recipe != "dit" else ""
        compiled = (" compiled per block" if self.per_block else " compiled") if self.compiled else ""
        graphed = " graphed" if self.graphed else ""
        return f"{self.model} {self.image_size}px {self.attention}{grid}{recipe} {self.precision}{compiled}{graphed}"


def goal_cases(precision: str) -> list[TrainingCase]:
    """The DiT-S/2 cases of TIME_GOALS and their MHSA baselines."""
    sizes = sorted({size for size, _ in TIME_GOALS})
    return [
        TrainingCase("DiT-S/2", size, attention, precision, contrast_grid=grid)
        for size in sizes
        for attention, grid in [("mhsa", None)] + [("vca", g) for s, g in TIME_GOALS if s == size]
    ]


def measure_training(
    case: TrainingCase,
    batch: int,
    warmup: int,
    steps: int,
    sizes: dict[str, int] | None = None,
    backend: str = "inductor",
) -> dict[str, Any]:
    """Images/s, seconds per step and peak GPU memory of `case`'s training step at batch `batch`, timed over `steps`
    steps after `warmup` (the first compiles under `compiled`; its excess over a steady step is the compile time).
    `sizes` overrides the model's depth, hidden_size, num_heads (the rehearsal's tiny models); `backend` is
    torch.compile's."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if case.precision == "bf16" else torch.float32
    latent = case.image_size // DOWNSAMPLING
    family = model_family(case.model)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: DiT-XL/2's 675 M parameters take seconds on a CPU
        spec = ModelSpec(
            case.model,
            attention=case.attention,
            input_size=latent,
            vca=VCAOptions(contrast_grid=case.contrast_grid),
            blocks=case.recipe,
            **(sizes or {}),
        )
        model = create_backbone(family, spec)
    from timm.utils import ModelEmaV3  # imported here: seconds (torchvision) that the layer parts do not need

    set_vca_kernel(model, "auto", device, "bench", dtype)  # the Triton core's first-use check, before compiling
    layers = [m for m in model.modules() if isinstance(m, VisualContrastAttention)]
    core = ("triton" if layers[0].runs_triton(device, dtype) else "aten") if layers else None
    # float32, as training.ema's dtype=torch.float32 makes it: the parameters are float32 here (autocast computes
    # in bf16). Without that argument, which timm before 1.0.31 lacks (the GPU machine's timm, 2026-12-04).
    ema = ModelEmaV3(model, decay=0.9999)
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=True if cuda else None, capturable=cuda and case.graphed
    )
    objective = create_objective(default_objective(family))
    if case.compiled:
        if case.per_block:  # should a torch key its guards on each block, each would count as a recompilation
            allow_recompilations(2 * len(model.blocks))
        for module in model.blocks if case.per_block else [model]:
            module.compile(fullgraph=True, backend=backend)
    x = torch.randn(batch, LATENT_CHANNELS, latent, latent, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)

    def learn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)  # before the step: a captured backward then writes them anew
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = objective.training_losses(model, x, y)["loss"].mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    learned = CapturedCalls(learn, pure=False) if case.graphed else learn
    warmup = max(warmup, WARMUP_CALLS + 2) if case.graphed else warmup  # the capture is a warm-up step

    def step() -> None:
        learned(x, y)
        ema.update(model)

    started = time.perf_counter()
    step()
    synchronize(device)
    first = time.perf_counter() - started
    for _ in range(warmup - 1):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    seconds = (time.perf_counter() - started) / steps
    return {
        **asdict(case),
        "label": case.label,
        "batch": batch,
        "vca_core": core,
        "seconds_per_step": seconds,
        "images_per_s": batch / seconds,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "compile_seconds": first - seconds if case.compiled else None,
        "graphs": learned.graphs if case.graphed else None,
    }
