"""An export in LightningDiT's checkpoint format: `python -m generation.lightning_writer EXPORT --out FOLDER`.

    python -m generation.lightning_writer results/tiny-lightning --out lightningdit-tiny
        lightningdit-tiny/lightningdit.pt    {"ema": state dict}, as LightningDiT's train.py saves it
        lightningdit-tiny/latents_stats.pt   {"mean", "std"} of shape (1, C, 1, 1), as its extract_features.py

The inverse of `generation.lightning`'s import, for a model trained here with LightningDiT's architecture (MHSA,
`model.blocks=lightning` or any of its block options, a `SiT-` name) and, where it normalised its latents per
channel (`vae.normalize=channels`), with their statistics: SwiGLU's `mlp.fc1`, `mlp.fc2` become `mlp.w12`, `mlp.w3`,
and the RoPE tables are added as LightningDiT's buffers (N, d), each pair's value twice. What it is for: a small
LightningDiT checkpoint to try the import and `sample.py --protocol lightningdit` on offline (the released ones are
a download of 2.7 GB each, and their VA-VAE is no diffusers autoencoder), and a model trained here for
LightningDiT's own code. Refused by name: VCA (LightningDiT has MHSA only), pixel space, DDPM (LightningDiT trains
rectified flow), another objective than the Linear path's velocity, a model without a null class.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from atomic_files import atomic_folder
from commands import CommandParser, UserError, run_command
from generation.autoguide import PREDICTION_SETTINGS
from generation.export import Export, read_export
from generation.lightning import LIGHTNING_OBJECTIVE, RENAMES, lightning_rope_tables

CHECKPOINT_FILE = "lightningdit.pt"
STATS_FILE = "latents_stats.pt"


class LightningFormatError(UserError):
    """An export that LightningDiT's code cannot hold (the message names what)."""


def check_writable_as_lightning(export: Export, source: str) -> None:
    """Refuse an export that has no LightningDiT counterpart, naming what differs."""
    description, model, objective = export.description, export.description.model, export.description.objective
    if model.attention != "mhsa":
        raise LightningFormatError(f"{source}: attention {model.attention}; LightningDiT has MHSA only")
    if model.mlp_ratio != 4:
        raise LightningFormatError(f"{source}: MLP ratio {model.mlp_ratio:g}; LightningDiT's is 4")
    if description.in_pixel_space:
        raise LightningFormatError(f"{source}: a pixel-space model; LightningDiT works on VAE latents")
    if any(getattr(objective, key, None) != getattr(LIGHTNING_OBJECTIVE, key) for key in PREDICTION_SETTINGS):
        raise LightningFormatError(
            f"{source}: objective {description.objective}; LightningDiT trains rectified flow (Linear path, velocity)"
        )
    if not description.has_null_class:
        raise LightningFormatError(f"{source}: trained without label dropout; LightningDiT's models have a null class")


def lightning_state_dict(export: Export) -> dict[str, torch.Tensor]:
    """The export's weights under LightningDiT's names, with its RoPE buffers where the model has RoPE."""
    spec = export.description.model
    state = {}
    for key, value in export.weights.items():
        for lightning, ours in RENAMES.items():
            key = key.replace(ours, lightning)
        state[key] = value
    if spec.rope:
        state.update(lightning_rope_tables(spec))
    return state


def write_lightning(export: Export, out: Path, source: str) -> list[Path]:
    """Write `out`/lightningdit.pt and, where the export has per-channel statistics, `out`/latents_stats.pt, as one
    new folder; the files written."""
    check_writable_as_lightning(export, source)
    description = export.description
    with atomic_folder(out) as folder:
        torch.save({"ema": lightning_state_dict(export)}, folder / CHECKPOINT_FILE)
        if description.latent_mean is not None:
            shape = (1, description.channels, 1, 1)
            stats = {
                "mean": torch.tensor(description.latent_mean).view(shape),
                "std": torch.tensor(description.latent_std).view(shape),
            }
            torch.save(stats, folder / STATS_FILE)
    return sorted(out.iterdir())


def main(argv: Sequence[str] | None = None) -> None:
    parser = CommandParser(prog="python -m generation.lightning_writer", description=__doc__)
    parser.add_argument("export", type=Path, help="an export, checkpoint or run folder (the newest export)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (must not exist yet)")
    args = parser.parse_args(argv)
    if args.out.exists():
        raise LightningFormatError(f"--out {args.out} exists; choose a new folder")
    from generation import ExportError

    try:
        export = read_export(args.export)
    except ExportError as error:
        raise LightningFormatError(f"{args.export}: {error}") from None
    written = write_lightning(export, args.out, str(args.export))
    model = export.description.model.name
    print(f"wrote {', '.join(str(path) for path in written)} ({model}, {export.description.channels} channels)")
    print(
        f"import it with: python -m generation.lightning {args.out / CHECKPOINT_FILE} --model {model} "
        f"--num-heads {export.description.model.num_heads} --vae {export.description.vae} "
        + (
            f"--latent-stats {args.out / STATS_FILE}"
            if export.description.latent_mean is not None
            else f"--no-latent-norm --latent-scale {export.description.latent_scale:g}"
        )
        + " --out EXPORT"
    )


def command() -> None:
    """`python -m generation.lightning_writer`: one line, exit 2 on a user error."""
    run_command(main)


if __name__ == "__main__":
    command()
