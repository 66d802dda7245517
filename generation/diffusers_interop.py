"""Convert the MHSA baseline (official DiT layout) to diffusers' `DiTTransformer2DModel` and back, so that a DiT
trained here runs in diffusers' `DiTPipeline` (and a diffusers DiT runs here).

The two layouts hold the same numbers under other names, with three differences:
  * the official model has one timestep and one label embedder; diffusers keeps a copy in every block
    (`transformer_blocks.i.norm1.emb`), of which the forward pass of block i uses its own. Converting to diffusers
    copies them; converting back requires all copies to be equal.
  * the fused `attn.qkv` projection is split into `to_q`, `to_k`, `to_v`.
  * diffusers computes its timestep frequencies as 10000^(-i/127) (`downscale_freq_shift=1`) where DiT uses
    10000^(-i/128); `to_diffusers` sets the shift to 0 on the converted model so its outputs equal ours. That
    setting is not part of diffusers' config: a folder reloaded with `from_pretrained` gets diffusers' own
    frequencies back (as the official facebook/DiT-XL-2-256 on the hub does) unless `use_dit_timestep_frequencies`
    is called on it. The position embedding is a fixed 2-D sin-cos table in both, not a weight.
Both unpatchify to (B, out_channels, H, W) in the same channel order: with learn_sigma the first in_channels
channels are epsilon and the rest the variance interpolation v, which `DiTPipeline` drops before its scheduler.

VCA models cannot be converted: diffusers' DiT block has only multi-head self-attention. `DiTPipeline` hard-codes
1000 as the null class of classifier-free guidance, so guided sampling in diffusers needs a 1000-class model.

Command: python -m generation.diffusers_interop SOURCE OUT_DIR [--vae VAE] [--model DiT-XL/2 --image-size 256]
SOURCE is anything `generation.load_export` reads: an export folder of our training (config.json +
ema.safetensors), a run directory, or an official DiT .pt (its name says model and size, e.g. DiT-XL-2-256x256.pt,
else --model and --image-size); OUT_DIR receives `transformer/` and `scheduler/` (DPM-Solver++ on
DiT's schedule, or UniPC), and with --vae a complete `DiTPipeline` folder.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from atomic_files import commit
from commands import CommandParser, UserError, run_command
from dit_vca.attention import MultiHeadSelfAttention
from dit_vca.diffusion import BETA_END, BETA_START, NUM_TIMESTEPS
from dit_vca.model_options import BLOCK_PRESETS
from dit_vca.model_spec import MODEL_SIZES
from dit_vca.models import DiT, create_model
from samplers.multistep import SCHEDULERS

if TYPE_CHECKING:
    from diffusers import DiTTransformer2DModel
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

SHARED_EMBEDDERS = {  # official key -> key inside each diffusers block's norm1.emb
    "t_embedder.mlp.0": "timestep_embedder.linear_1",
    "t_embedder.mlp.2": "timestep_embedder.linear_2",
    "y_embedder.embedding_table": "class_embedder.embedding_table",
}
BLOCK_LAYERS = {  # official key inside blocks.i -> key inside transformer_blocks.i (qkv is split separately)
    "attn.proj": "attn1.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm1.linear",
}
FINAL_LAYERS = {"final_layer.adaLN_modulation.1": "proj_out_1", "final_layer.linear": "proj_out_2"}
TOP_LAYERS = {"x_embedder.proj": "pos_embed.proj", **FINAL_LAYERS}
QKV = ("to_q", "to_k", "to_v")
PARAMETERS = ("weight", "bias")
DIFFUSERS_MLP_RATIO = 4  # DiTTransformer2DModel's feed-forward width is fixed at 4x the hidden size
DIFFUSERS_NULL_CLASS = (
    1000  # DiTPipeline's null class of guidance, hard-coded: models of other class counts cannot guide
)
NORM_EPS = 1e-6  # the official DiT's LayerNorm eps (diffusers' default norm_eps is 1e-5)


class ConversionError(UserError):
    """The model cannot be expressed in the other layout (VCA attention, unsupported sizes, unequal copies)."""


class SourceError(UserError):
    """A bad command-line input: missing or unreadable source, bad --vae, existing output folder."""


# ----------------------------------------------------------------------------------------------------------------
# State dicts
# ----------------------------------------------------------------------------------------------------------------


def official_to_diffusers_state_dict(state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """Rename an official-layout state dict (MHSA) for a `DiTTransformer2DModel` of `depth` blocks.

    `pos_embed` (a fixed sin-cos table, not a weight in diffusers) is dropped; the caller checks that it equals
    diffusers' table."""
    out = {}
    for old, new in TOP_LAYERS.items():
        for p in PARAMETERS:
            out[f"{new}.{p}"] = state[f"{old}.{p}"]
    for i in range(depth):
        for old, new in SHARED_EMBEDDERS.items():
            for p in PARAMETERS:
                if f"{old}.{p}" in state:  # the embedding table has no bias
                    out[f"transformer_blocks.{i}.norm1.emb.{new}.{p}"] = state[f"{old}.{p}"]
        for old, new in BLOCK_LAYERS.items():
            for p in PARAMETERS:
                out[f"transformer_blocks.{i}.{new}.{p}"] = state[f"blocks.{i}.{old}.{p}"]
        for p in PARAMETERS:
            for name, part in zip(QKV, state[f"blocks.{i}.attn.qkv.{p}"].chunk(3, dim=0)):
                out[f"transformer_blocks.{i}.attn1.{name}.{p}"] = part
    return out


def diffusers_to_official_state_dict(state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """The inverse of `official_to_diffusers_state_dict`, without `pos_embed`; raises ConversionError when the
    blocks' embedder copies differ (a model trained in diffusers with untied embedders)."""
    out = {}
    for old, new in TOP_LAYERS.items():
        for p in PARAMETERS:
            out[f"{old}.{p}"] = state[f"{new}.{p}"]
    for old, new in SHARED_EMBEDDERS.items():
        for p in PARAMETERS:
            copies = [state.get(f"transformer_blocks.{i}.norm1.emb.{new}.{p}") for i in range(depth)]
            if copies[0] is None:
                continue
            if any(not torch.equal(copy, copies[0]) for copy in copies[1:]):
                raise ConversionError(
                    f"the blocks' copies of norm1.emb.{new}.{p} differ; the official layout has one shared {old}"
                )
            out[f"{old}.{p}"] = copies[0]
    for i in range(depth):
        for old, new in BLOCK_LAYERS.items():
            for p in PARAMETERS:
                out[f"blocks.{i}.{old}.{p}"] = state[f"transformer_blocks.{i}.{new}.{p}"]
        for p in PARAMETERS:
            out[f"blocks.{i}.attn.qkv.{p}"] = torch.cat(
                [state[f"transformer_blocks.{i}.attn1.{name}.{p}"] for name in QKV], dim=0
            )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


def _check_convertible(model: DiT) -> None:
    if not all(isinstance(block.attn, MultiHeadSelfAttention) for block in model.blocks):
        raise ConversionError(
            "only the MHSA baseline can be converted to diffusers: DiTTransformer2DModel has no "
            "Visual-Contrast Attention (this model was built with attention='vca')"
        )
    spec = model.spec
    changed = {key: value for key, value in spec.block_options.items() if BLOCK_PRESETS["dit"][key] != value}
    if changed:
        raise ConversionError(
            f"block options {changed} cannot be converted: DiTTransformer2DModel has LayerNorm blocks, a GELU MLP "
            f"and neither QK-norm nor RoPE"
        )
    name = spec.name
    if not name.startswith("DiT-"):
        raise ConversionError(
            f"{name} is a SiT (velocity) model; diffusers' DiT pipeline expects an epsilon (DDPM) model"
        )
    hidden = model.pos_embed.shape[-1]
    if model.blocks[0].mlp.fc1.out_features != DIFFUSERS_MLP_RATIO * hidden:
        raise ConversionError(
            f"mlp_ratio {model.blocks[0].mlp.fc1.out_features / hidden:g} is not supported: "
            f"DiTTransformer2DModel's MLP is {DIFFUSERS_MLP_RATIO}x the hidden size"
        )
    if model.y_embedder.dropout_prob <= 0:
        raise ConversionError(
            "a model trained without label dropout (class_dropout_prob=0) has no null-class row; "
            "DiTTransformer2DModel always has one"
        )


def use_dit_timestep_frequencies(transformer: DiTTransformer2DModel) -> DiTTransformer2DModel:
    """Make diffusers' timestep features those of the official DiT (frequencies 10000^(-i/128)); in place."""
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    return transformer


def to_diffusers(model: DiT) -> DiTTransformer2DModel:
    """A `DiTTransformer2DModel` computing what the MHSA `model` computes (float32, eval mode)."""
    from diffusers import DiTTransformer2DModel

    _check_convertible(model)
    hidden, depth = model.pos_embed.shape[-1], len(model.blocks)
    transformer = DiTTransformer2DModel(
        num_attention_heads=model.spec.num_heads,
        attention_head_dim=hidden // model.spec.num_heads,
        in_channels=model.spec.in_channels,
        out_channels=model.out_channels,
        num_layers=depth,
        sample_size=model.spec.input_size,
        patch_size=model.patch_size,
        num_embeds_ada_norm=model.spec.num_classes,
        norm_eps=NORM_EPS,
    )
    state = {key: value.detach().float().cpu() for key, value in model.state_dict().items()}
    if not torch.allclose(state["pos_embed"], transformer.pos_embed.pos_embed.float(), atol=1e-6):
        raise ConversionError("the model's pos_embed is not the fixed 2-D sin-cos table that diffusers computes")
    transformer.load_state_dict(official_to_diffusers_state_dict(state, depth), strict=True)
    return use_dit_timestep_frequencies(transformer).eval()


def from_diffusers(transformer: DiTTransformer2DModel, name: str | None = None) -> DiT:
    """Our MHSA `DiT` from a `DiTTransformer2DModel`; `name` ("DiT-XL/2") defaults to the standard size that
    matches (depth, width, heads), else DiT-S/<patch> with those overrides. Raises ConversionError when the
    transformer's configuration has no counterpart here."""
    config = transformer.config
    hidden = config.num_attention_heads * config.attention_head_dim
    unsupported = {
        key: config[key]
        for key, expected in (
            ("norm_type", "ada_norm_zero"),
            ("activation_fn", "gelu-approximate"),
            ("norm_elementwise_affine", False),
            ("attention_bias", True),
        )
        if config[key] != expected
    }
    if unsupported:
        raise ConversionError(
            f"DiTTransformer2DModel settings without a counterpart in the official DiT: {unsupported}"
        )
    out_channels = config.out_channels or config.in_channels
    if out_channels not in (config.in_channels, 2 * config.in_channels):
        raise ConversionError(f"out_channels={out_channels} is neither in_channels nor 2 x in_channels")
    if name is None:
        size = next(
            (
                size
                for size, dims in MODEL_SIZES.items()
                if dims == (config.num_layers, hidden, config.num_attention_heads)
            ),
            "S",
        )
        name = f"DiT-{size}/{config.patch_size}"
    model = create_model(
        name,
        attention="mhsa",
        input_size=config.sample_size,
        in_channels=config.in_channels,
        num_classes=config.num_embeds_ada_norm,
        learn_sigma=out_channels == 2 * config.in_channels,
        depth=config.num_layers,
        hidden_size=hidden,
        num_heads=config.num_attention_heads,
    )
    state = diffusers_to_official_state_dict(transformer.state_dict(), config.num_layers)
    state["pos_embed"] = model.pos_embed.detach().clone()
    model.load_state_dict(state, strict=True)
    return model.eval()


def dit_scheduler(solver: str = "dpm++2m") -> SchedulerMixin:
    """The diffusers scheduler of our sampler `solver` ("dpm++2m" or "unipc") on DiT's 1000-step linear-beta
    schedule, written as beta_start/beta_end so that its saved config stays readable."""
    if solver not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {solver!r}; expected one of {sorted(SCHEDULERS)}")
    return SCHEDULERS[solver](
        num_train_timesteps=NUM_TIMESTEPS, beta_start=BETA_START, beta_end=BETA_END, beta_schedule="linear"
    )


# ----------------------------------------------------------------------------------------------------------------
# Command
# ----------------------------------------------------------------------------------------------------------------


def load_mhsa_model(source: str | Path, model: str | None = None, image_size: int | None = None) -> nn.Module:
    """Our MHSA model from what `generation.load_export` reads: an export / checkpoint / run folder, or an official
    DiT `.pt` (weights_only; model and size from its name or `model` / `image_size`)."""
    from generation import ExportError, load_export
    from generation.official import OfficialCheckpointError

    try:
        export = load_export(source, model, image_size)
    except (ExportError, OfficialCheckpointError) as error:
        raise SourceError(str(error)) from None
    kind = export.description.objective.kind
    if kind != "diffusion":
        raise SourceError(f"{source}: objective {kind!r}; only DDPM (DiT) models run in DiTPipeline")
    model = DiT(export.description.model)
    model.load_state_dict(export.weights, strict=True)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = CommandParser(
        prog="python -m generation.diffusers_interop", description="Write a DiT (MHSA baseline) as a diffusers folder."
    )
    parser.add_argument("source", help="export folder, run directory, or official DiT .pt (path or released name)")
    parser.add_argument("out_dir", type=Path, help="new folder for the diffusers files (must not exist)")
    parser.add_argument("--vae", help="AutoencoderKL folder or hub id: also write a complete DiTPipeline")
    parser.add_argument(
        "--scheduler",
        default="dpm++2m",
        choices=sorted(SCHEDULERS),
        help="the pipeline's scheduler (DiTPipeline passes it only the epsilon half)",
    )
    parser.add_argument("--model", help="official checkpoints whose file name does not say it: e.g. DiT-XL/2")
    parser.add_argument("--image-size", type=int, help="official checkpoints: image side in pixels")
    args = parser.parse_args(argv)
    try:
        convert(args.source, args.out_dir, args.vae, args.scheduler, args.model, args.image_size)
    except ConversionError as error:
        raise ConversionError(f"{args.source}: {error}") from None


def convert(
    source: str | Path,
    out_dir: Path,
    vae_name: str | None = None,
    solver: str = "dpm++2m",
    model: str | None = None,
    image_size: int | None = None,
) -> None:
    """Write the MHSA model of `source` as diffusers folders in `out_dir` (whole or not at all): `transformer/` and
    `scheduler/`, or with `vae_name` a complete `DiTPipeline`."""
    if out_dir.exists():
        raise SourceError(f"{out_dir} exists; choose a new output folder (nothing is overwritten)")
    vae = None
    if vae_name is not None:
        from generation.vae import VAEUnavailableError, load_vae

        try:
            vae = load_vae(vae_name, option="--vae")
        except VAEUnavailableError as error:
            raise SourceError(f"--vae {vae_name}: {error}") from None
    mhsa_model = load_mhsa_model(source, model, image_size)
    transformer = to_diffusers(mhsa_model)  # refuses what cannot be converted, before any warning
    if mhsa_model.spec.num_classes != DIFFUSERS_NULL_CLASS:
        print(
            f"warning: {source} has {mhsa_model.spec.num_classes} classes; DiTPipeline takes class "
            f"{DIFFUSERS_NULL_CLASS} as the null class of guidance, so pipeline(..., guidance_scale > 1) (its "
            f"default is 4) fails with an IndexError for this model: call it with guidance_scale=1, or sample "
            f"guided with sample.py",
            file=sys.stderr,
        )
    scheduler = dit_scheduler(solver)
    # Written beside the target and renamed once complete, so out_dir is either whole or absent.
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    try:
        if vae is not None:
            from diffusers import DiTPipeline

            DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler).save_pretrained(staging)
        else:
            transformer.save_pretrained(staging / "transformer")
            scheduler.save_pretrained(staging / "scheduler")
        commit(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {out_dir}" + ("" if vae_name else " (transformer/ and scheduler/; add --vae for a pipeline)"))


if __name__ == "__main__":
    run_command(main)
