"""LightningDiT checkpoints (hustvl/LightningDiT) as exports of the shared backbone with MHSA.

    python -m generation.lightning lightningdit.pt --model SiT-XL/1 --vae vae/my-f16d32 \
        --latent-stats latents_stats.pt --out exports/lightning-xl1
    python -m generation.lightning 1p0b.pt --model SiT-XL/1 --num-heads 24 ...   # LightningDiT-1p0B/1: wider

LightningDiT's layout is the official DiT's plus, per option, what `lightning_options` reads from the keys:
RMSNorm gains (`blocks.i.norm1.weight`, `norm2.weight`, `final_layer.norm_final.weight`), the SwiGLU matrices
`blocks.i.mlp.w12` and `mlp.w3` (timm's GluMlp `mlp.fc1` and `mlp.fc2` here: same shapes, the gate the first half
of w12's output), the QK-norm gains `attn.q_norm.weight` and `attn.k_norm.weight`, and the 2-D RoPE tables
`feat_rope.freqs_cos` and `feat_rope.freqs_sin`, which the backbone computes from its shape: they are compared with
its own (so a checkpoint of another rotation convention is refused) and dropped. Not supported, and refused by name:
adaLN without shift (`wo_shift`, a 4C modulation) and QK-norm as LayerNorm (LightningDiT's choice when its blocks
keep LayerNorm).

LightningDiT trains rectified flow (SiT's Linear path, velocity prediction), so the model is a "SiT-" name, and
normalises its latents per channel, (z − mean) / std times a multiplier (1): `--latent-stats` is the
`latents_stats.pt` its training wrote ({"mean", "std"} of shape (1, C, 1, 1)), required unless `--no-latent-norm`
says the checkpoint was trained without (an export without the statistics would decode wrongly, silently), `--vae`
a diffusers AutoencoderKL of that latent space. Sample the export as LightningDiT does with `sample.py
--protocol lightningdit` (generation/protocols.py). Files are read with weights_only=True
(generation.official.load_state_dict).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from commands import CommandParser, run_command
from dit_vca.model_spec import ModelSpec, model_family, name_size
from dit_vca.rope import RotaryEmbedding2d
from generation.export import Export, ExportDescription
from generation.official import OfficialCheckpointError, check_fits, load_state_dict, write_converted
from objectives import TransportSpec

RENAMES = {".mlp.w12.": ".mlp.fc1.", ".mlp.w3.": ".mlp.fc2."}  # LightningDiT's SwiGLU -> timm's GluMlp
ROPE_TABLES = ("feat_rope.freqs_cos", "feat_rope.freqs_sin")
# float32 tables against the backbone's float64-derived ones: LightningDiT rounds positions · ω in float32 before the
# cosine (angles up to ~15 rad, one ulp ~1e-6), so equal tables agree to ~1e-5; another convention differs by O(1).
ROPE_TOLERANCE = 1e-4
SHAPE_KEYS = ("pos_embed", "final_layer.linear.weight", "y_embedder.embedding_table.weight")  # read for the config
LIGHTNING_OBJECTIVE = TransportSpec(path="linear", prediction="velocity")


def lightning_options(state: dict[str, torch.Tensor], source: str) -> dict[str, object]:
    """The block options (norm, mlp, qk_norm, rope) a LightningDiT state dict was trained with, from its keys."""
    if "blocks.0.adaLN_modulation.1.weight" not in state or "x_embedder.proj.weight" not in state:
        raise OfficialCheckpointError(f"{source} is not a DiT-layout state dict (no blocks.0.adaLN_modulation)")
    width = state["x_embedder.proj.weight"].shape[0]
    if state["blocks.0.adaLN_modulation.1.weight"].shape[0] != 6 * width:
        raise OfficialCheckpointError(f"{source}: adaLN without shift (LightningDiT's wo_shift) is not supported")
    if "blocks.0.attn.q_norm.bias" in state:
        raise OfficialCheckpointError(f"{source}: QK-norm as LayerNorm is not supported (only as RMSNorm)")
    return dict(
        norm="rmsnorm" if "blocks.0.norm1.weight" in state else "layernorm",
        mlp="swiglu" if "blocks.0.mlp.w12.weight" in state else "gelu",
        qk_norm="blocks.0.attn.q_norm.weight" in state,
        rope=ROPE_TABLES[0] in state,
    )


def lightning_model_spec(
    state: dict[str, torch.Tensor], name: str, source: str, num_heads: int | None = None
) -> ModelSpec:
    """The backbone's spec (resolved) of a LightningDiT state dict for the name `name` (e.g. "SiT-XL/1"): its
    patch size and, unless `num_heads` is given, its heads (which no shape tells); depth, width, channels, latent
    side, classes and learn_sigma are read from the shapes, the block options from the keys."""
    options = lightning_options(state, source)
    (_, name_width, name_heads), patch = name_size(name)
    width = state["x_embedder.proj.weight"].shape[0]
    if num_heads is None and width != name_width:
        raise OfficialCheckpointError(
            f"{source} is {width} wide, {name} {name_width}: give its number of heads (--num-heads)"
        )
    missing = [key for key in SHAPE_KEYS if key not in state]
    if missing:
        raise OfficialCheckpointError(f"{source} has no {', '.join(missing)}: not a LightningDiT state dict")
    check_patch_size(state, name, patch, source)
    in_channels = state["x_embedder.proj.weight"].shape[1]
    tokens = state["pos_embed"].shape[1]
    outputs = state["final_layer.linear.weight"].shape[0] // (patch * patch)
    if math.isqrt(tokens) ** 2 != tokens or outputs not in (in_channels, 2 * in_channels):
        raise OfficialCheckpointError(
            f"{source} does not fit --model {name}: {tokens} tokens (not a square grid) or {outputs} output channels "
            f"per pixel ({in_channels} or {2 * in_channels} expected)"
        )
    spec = ModelSpec(
        name,
        attention="mhsa",
        input_size=math.isqrt(tokens) * patch,
        in_channels=in_channels,
        num_classes=state["y_embedder.embedding_table.weight"].shape[0] - 1,  # the null class is the last row
        learn_sigma=outputs == 2 * in_channels,
        depth=len({key.split(".")[1] for key in state if key.startswith("blocks.")}),
        hidden_size=width,
        num_heads=name_heads if num_heads is None else num_heads,
        **options,
    )
    return spec.resolved()


def check_patch_size(state: dict[str, torch.Tensor], name: str, patch: int, source: str) -> None:
    """The patch size of the checkpoint's patch embedding (a p x p convolution) is the name's, else an error naming
    both and the name that fits."""
    found = state["x_embedder.proj.weight"].shape[-1]
    if found != patch:
        fitting = f"{name.rsplit('/', 1)[0]}/{found}"
        raise OfficialCheckpointError(
            f"{source} has patch size {found} (x_embedder.proj.weight {tuple(state['x_embedder.proj.weight'].shape)}),"
            f" --model {name} patch size {patch}: use --model {fitting}"
        )


def lightning_rope_tables(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The RoPE buffers of a LightningDiT model of the backbone's (resolved) `spec`, as the backbone computes them:
    LightningDiT's (N, d), each pair's value twice (ours are (N, d/2), once per pair)."""
    rope = RotaryEmbedding2d(spec.hidden_size // spec.num_heads, spec.input_size // spec.patch_size)
    return {key: table.repeat_interleave(2, dim=1) for key, table in zip(ROPE_TABLES, (rope.cos, rope.sin))}


def backbone_state_dict(state: dict[str, torch.Tensor], spec: ModelSpec, source: str) -> dict[str, torch.Tensor]:
    """The state dict of the backbone of the (resolved) `spec` from a LightningDiT one: SwiGLU keys renamed, the RoPE
    tables checked against the backbone's own and dropped."""
    converted = {}
    for key, value in state.items():
        for old, new in RENAMES.items():
            key = key.replace(old, new)
        converted[key] = value
    if spec.rope:
        for key, table in lightning_rope_tables(spec).items():
            found = converted.pop(key)
            # a table stored in half precision is rounded to half an ulp at 1 (float16: 4.9e-4, bfloat16: 3.9e-3)
            tolerance = max(ROPE_TOLERANCE, torch.finfo(found.dtype).eps)
            found = found.float()
            if found.shape != table.shape or not torch.allclose(found, table, atol=tolerance, rtol=0):
                raise OfficialCheckpointError(
                    f"{source}: {key} {tuple(found.shape)} is not the 2-D RoPE of dit_vca.rope for "
                    f"{table.shape[1]}-channel heads on a {int(math.isqrt(table.shape[0]))}-token grid side"
                )
    return converted


def floating_weights(state: dict[str, torch.Tensor], source: str) -> str | None:
    """Refuse a state dict with a tensor that is not floating point (an integer "weight" would be cast to float32
    without a word); a note for the command to print when the weights are in another precision than float32 (a
    float16 or bfloat16 checkpoint, cast to float32 by the export), else None."""
    integer = next((key for key, value in state.items() if not value.is_floating_point()), None)
    if integer is not None:
        raise OfficialCheckpointError(
            f"{source}: {integer} holds {str(state[integer].dtype).removeprefix('torch.')} values; a LightningDiT "
            f"checkpoint's weights are floating point"
        )
    other = sorted({str(value.dtype).removeprefix("torch.") for value in state.values()} - {"float32"})
    return f"{source}: {' and '.join(other)} weights, cast to float32 in the export" if other else None


def read_latent_stats(path: Path, channels: int) -> tuple[list[float], list[float]]:
    """(mean, std) per channel from LightningDiT's latents_stats.pt ({"mean", "std"}, each C values in any shape)."""
    stats = load_state_dict(path)  # a dict of tensors, read with weights_only=True
    if set(stats) != {"mean", "std"} or stats["mean"].numel() != channels or stats["std"].numel() != channels:
        raise OfficialCheckpointError(
            f"--latent-stats {path}: expected {{'mean', 'std'}} with {channels} values each (the model's channels), "
            f"found { ({key: tuple(value.shape) for key, value in stats.items()}) }"
        )
    if not bool((stats["std"] > 0).all()):
        raise OfficialCheckpointError(f"--latent-stats {path}: every std must be > 0")
    return stats["mean"].flatten().double().tolist(), stats["std"].flatten().double().tolist()


def check_latent_stats(latent_stats: str | Path | None, latent_norm: bool) -> None:
    """Statistics given exactly when the checkpoint was trained with LightningDiT's latent_norm: without them an
    export of such a model decodes wrongly, silently (every released LightningDiT model normalises its latents)."""
    if latent_norm and latent_stats is None:
        raise OfficialCheckpointError(
            "--latent-stats missing: LightningDiT normalises its latents per channel (latent_norm: true in every "
            "released config), and sampling must undo it; give the latents_stats.pt of its training latents, or "
            "--no-latent-norm for a checkpoint trained with latent_norm: false"
        )
    if not latent_norm and latent_stats is not None:
        raise OfficialCheckpointError(
            f"--latent-stats {latent_stats} with --no-latent-norm: the statistics are for a model trained with "
            "latent_norm; give one of the two"
        )


def lightning_export(
    ckpt: str | Path,
    model: str,
    vae: str,
    latent_stats: str | Path | None,
    latent_scale: float = 1.0,
    num_heads: int | None = None,
    latent_norm: bool = True,
) -> Export:
    """A LightningDiT checkpoint as an in-memory export: the MHSA backbone with the checkpoint's block options, the
    Linear velocity transport, latents decoded by `vae` after undoing the per-channel statistics `latent_stats`
    (required unless `latent_norm` is False: a checkpoint trained without LightningDiT's latent_norm, scale only)."""
    from generation.vae import latent_downsampling, load_vae, vae_source

    source = str(ckpt)
    try:
        family = model_family(model)
    except ValueError as error:
        raise OfficialCheckpointError(f"--model: {error}") from None
    if family != "SiT":
        raise OfficialCheckpointError(f"--model {model}: LightningDiT trains rectified flow; name its size as SiT-")
    if not latent_scale > 0:
        raise OfficialCheckpointError(f"--latent-scale {latent_scale}: expected a value > 0")
    check_latent_stats(latent_stats, latent_norm)
    state = load_state_dict(Path(ckpt))
    precision = floating_weights(state, source)
    spec = lightning_model_spec(state, model, source, num_heads)
    weights = backbone_state_dict(state, spec, source)
    autoencoder = load_vae(vae, option="--vae")  # fails before anything is written
    if autoencoder.config.latent_channels != spec.in_channels:
        raise OfficialCheckpointError(
            f"--vae {vae} has {autoencoder.config.latent_channels} latent channels, the checkpoint's model "
            f"{spec.in_channels}"
        )
    mean, std = read_latent_stats(Path(latent_stats), spec.in_channels) if latent_stats is not None else (None, None)
    description = ExportDescription(
        model=spec,
        objective=LIGHTNING_OBJECTIVE,
        space="latents",
        image_size=spec.input_size * latent_downsampling(autoencoder.config),
        num_classes=spec.num_classes,
        vae=vae_source(vae).name,
        vae_path=vae_source(vae).path,
        latent_scale=latent_scale,
        latent_mean=mean,
        latent_std=std,
        source=source,
    )
    check_fits(description, weights, source)
    if precision is not None:
        print(precision)
    return Export(description, {key: value.float() for key, value in weights.items()})


def main(argv: Sequence[str] | None = None) -> None:
    parser = CommandParser(prog="python -m generation.lightning", description=__doc__)
    parser.add_argument("ckpt", type=Path, help="a LightningDiT .pt (bare EMA state dict or training checkpoint)")
    parser.add_argument("--model", required=True, help="the size, as a SiT name, e.g. SiT-XL/1 (LightningDiT-XL/1)")
    parser.add_argument("--vae", required=True, help="diffusers AutoencoderKL folder or hub id of the latent space")
    parser.add_argument(
        "--latent-stats", type=Path, help="latents_stats.pt of the training latents (required: latent_norm)"
    )
    parser.add_argument(
        "--no-latent-norm",
        dest="latent_norm",
        action="store_false",
        help="the checkpoint was trained with latent_norm: false (no statistics; LightningDiT's configs set true)",
    )
    parser.add_argument("--latent-scale", type=float, default=1.0, help="LightningDiT's latent_multiplier (1.0)")
    parser.add_argument("--num-heads", type=int, help="attention heads, where the width is not the name's")
    parser.add_argument("--out", type=Path, required=True, help="export folder to write (must not exist yet)")
    args = parser.parse_args(argv)
    write_converted(
        args.out,
        lambda: lightning_export(
            args.ckpt, args.model, args.vae, args.latent_stats, args.latent_scale, args.num_heads, args.latent_norm
        ),
    )


def command() -> None:
    """`python -m generation.lightning`: one line, exit 2 on a user error."""
    run_command(main)


if __name__ == "__main__":
    command()
