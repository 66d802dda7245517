"""Bits per dimension of images under an interpolant (SiT) model: `python -m generation.likelihood`.

    python -m generation.likelihood --ckpt results/sit-digits --images samples.npz --num-images 256 --json bpd.json

The model's probability-flow ODE gives the log-density log p of a point of the model's space
(`Transport.log_likelihood`: the ODE and the divergence of its velocity integrated from the point back to the
N(0, I) prior, by dopri5 at --atol/--rtol, the divergence by Hutchinson's estimator with one Rademacher probe per
image held through the solve, or exactly with --divergence exact: one backward pass per dimension). Of class
`arr_1` of the images file (as sample.py writes it), or --label K, or --label null for the unconditional density
of a model trained with label dropout; no guidance. What the figure includes:

- Pixel-space models: the 8-bit value k of a pixel is the bin [(k - 128) / 127.5, (k - 127) / 127.5) of the
  model's range (sample.py's rounding, floor(127.5 x + 128)), of width 1/127.5. With --dequantization uniform (the
  default) x = (k - 128 + u) / 127.5, u ~ U[0, 1) per dimension, drawn per image from --seed, and
  bits/dim = (-log p(x) + D ln 127.5) / (D ln 2), D = C x H x W of the model: in expectation over u an upper bound
  on -log2 P(k) / D of the 8-bit images (Jensen). With --dequantization none x = k / 127.5 - 1, the bin's centre
  and the training input: the same formula, then a density evaluated on the grid, not a bound.
- Latent models: z is the VAE encoder's posterior mean of x = k / 127.5 - 1, and the flow integrates from the
  latents the model saw in training, w = scale (z - mean_c) / std_c with the export's per-channel statistics
  (vae.normalize=channels, LightningDiT's latent norm, every imported LightningDiT checkpoint), or w = scale z
  without them. The figure is the density of z, the VAE's own latent space, whatever the normalisation:
  bits/dim = (-log p(w) - log |det dw/dz|) / (D ln 2), log |det dw/dz| = h w sum_c log(scale / std_c), D = C x h x w
  of the latents; so two models of one latent space compare whatever statistics each was trained with. The
  density of w itself is reported beside it (`model_space_bits_per_dim`). The latent likelihood only: no term of
  the VAE (no decoder likelihood, no posterior entropy), so it bounds nothing about the images; no dequantisation
  (latents are continuous).

--images is an .npz (arr_0 uint8 (N, H, W, 3), labels arr_1, as sample.py writes) or a folder of image files,
read as `python -m fid` reads one (every image file under it, in sorted path order, all of one size); a folder
has no labels, so it needs --label K or --label null.

A bad argument, an export of another objective, or images the model cannot take are one line and exit status 2
before the model is loaded.
"""

from __future__ import annotations

import argparse
import math
import os
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from atomic_files import check_writable, write_json_atomic
from atomic_files.ownership import json_object_with, refuse_foreign
from commands import CommandParser, UserError, check_device, launch_rank, run_command
from generation.sample_plan import sample_seeds
from objectives import DEFAULT_ATOL, DEFAULT_RTOL

if TYPE_CHECKING:
    import torch

    from generation.export import ExportDescription
    from generation.vae import LatentNormalization
    from sit_vca import Transport

DEQUANTIZATIONS = ("uniform", "none")
PIXEL_BIN = 1 / 127.5  # width of an 8-bit value's bin in the model's [-1, 1]
REPORT_KEYS = ("bits_per_dim", "per_image", "settings")  # what makes a JSON file a --json report of this command


class LikelihoodError(UserError):
    """Images or an export that the likelihood cannot be computed for (the message names the argument)."""


@dataclass(frozen=True)
class ModelSpace:
    """How 8-bit images become points of the model's space, and what bits per dimension then include.

    `channels`: the model's input channels in pixel space (1: gray images, read from the red channel);
    `vae` and `normalization`: the encoder of a latent model and the map from its latents to the model's inputs
    (the export's `latent_normalization`); `dequantization`: "uniform" or "none" (pixels)."""

    channels: int = 3
    vae: Any = None  # diffusers AutoencoderKL of a latent model
    normalization: LatentNormalization | None = None
    dequantization: str = "uniform"

    @property
    def latent(self) -> bool:
        return self.vae is not None

    def points(self, images: np.ndarray, seeds: Sequence[int], device, dtype) -> torch.Tensor:
        """(B, C, h, w) model-space points of uint8 images (B, H, W, 3); image i's dequantisation noise comes from
        its own stream seeded by seeds[i] (so it does not depend on the batch)."""
        import torch

        pixels = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).to(torch.float64)  # (B, 3, H, W)
        if self.latent:
            from generation.vae import encode_posterior

            x = (pixels / 127.5 - 1).to(device, torch.float32)
            mean, _ = encode_posterior(self.vae, x)  # (B, C, h, w): z
            return self.normalization.to_model(mean.double()).to(dtype)  # (B, C, h, w): what the model saw
        pixels = pixels[:, : self.channels]
        if self.dequantization == "none":
            return (pixels / 127.5 - 1).to(device, dtype)
        shape = pixels.shape[1:]
        u = torch.stack([torch.from_numpy(np.random.default_rng(seed).random(shape)) for seed in seeds])  # [0, 1)
        return ((pixels - 128 + u) * PIXEL_BIN).to(device, dtype)

    def offset(self, shape: Sequence[int]) -> float:
        """Nats per image added to -log p of a model-space point of `shape` (C, h, w) before dividing by D ln 2: the
        bin width's D ln 127.5 for pixels; for latents -log |det| of the map from the VAE's latents to the model's
        inputs (`LatentNormalization.log_abs_det`), so that the figure is the density of the VAE's latents."""
        channels, *spatial = shape
        if self.latent:
            return -self.normalization.log_abs_det(channels, math.prod(spatial))
        return math.prod(shape) * math.log(127.5)

    def describe(self) -> str:
        if self.latent:
            normalization = self.normalization
            model_input = (
                f"{normalization.scale:g} (z - mean_c) / std_c with the export's per-channel statistics"
                if normalization.mean is not None
                else f"{normalization.scale:g} z"
            )
            return (
                "latent likelihood only: (-log p(w) - log |det dw/dz|) / (D ln 2), the density of z, the VAE "
                f"encoder's posterior mean, through the flow from w = {model_input} (what the model saw); no VAE "
                "term (not a bound on the images' bits), no dequantisation"
            )
        if self.dequantization == "none":
            return (
                "(-log p(x) + D ln 127.5) / (D ln 2) at the bins' centres x = k / 127.5 - 1 of the 8-bit values "
                "(a density on the grid, not a bound)"
            )
        return (
            "(-log p(x) + D ln 127.5) / (D ln 2) of x uniformly dequantised within each 8-bit value's bin of width "
            "1/127.5: in expectation an upper bound on the 8-bit images' bits/dim"
        )


@dataclass(frozen=True)
class BitsPerDim:
    """Per image: bits per dimension and the model-space log-density (nats) it came from; D, what the figure
    includes, and the model evaluations of the solver (summed over batches)."""

    bits: np.ndarray  # (N,)
    log_prob: np.ndarray  # (N,) nats, of the model-space points
    dims: int
    includes: str
    nfe: int

    @property
    def model_space_bits(self) -> np.ndarray:
        """-log p / (D ln 2) of the model-space points themselves (N,): for latents, of the normalised latents the
        flow integrates from, without the log-determinant of the normalisation."""
        return -self.log_prob / (self.dims * math.log(2))

    @property
    def mean(self) -> float:
        return float(self.bits.mean())

    @property
    def standard_error(self) -> float | None:
        return float(self.bits.std(ddof=1) / math.sqrt(len(self.bits))) if len(self.bits) > 1 else None


def bits_per_dim(
    model_fn: Callable,
    transport: Transport,
    batches: Sequence[tuple[np.ndarray, np.ndarray]] | Any,
    space: ModelSpace,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: Any = None,
    divergence: str = "hutchinson",
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    progress: bool = False,
) -> BitsPerDim:
    """Bits per dimension of every image of `batches` ((images (B, H, W, 3) uint8, labels (B,)) pairs, in index
    order) under the probability-flow ODE of `model_fn` and `transport`. Image i draws its dequantisation noise
    and its Hutchinson probe from streams seeded by (seed, i) (generation.sample_plan.sample_seeds)."""
    import torch

    from samplers import PerSampleNoise

    dtype = dtype or torch.float32
    bits, log_probs, nfe, start, dims = [], [], 0, 0, 0
    for images, labels in batches:
        seeds = sample_seeds(seed, range(start, start + len(images)))
        x = space.points(images, seeds, device, dtype)  # (B, C, h, w)
        dims = x[0].numel()
        y = torch.as_tensor(np.asarray(labels), dtype=torch.long, device=device)  # (B,)
        result = transport.log_likelihood(
            model_fn,
            x,
            y,
            atol=atol,
            rtol=rtol,
            divergence=divergence,
            noise=PerSampleNoise(seeds, device),
            progress=progress,
        )
        log_prob = result.log_prob.double().cpu().numpy()  # (B,) nats
        log_probs.append(log_prob)
        bits.append((-log_prob + space.offset(x.shape[1:])) / (dims * math.log(2)))
        nfe += result.nfe
        start += len(images)
    return BitsPerDim(np.concatenate(bits), np.concatenate(log_probs), dims, space.describe(), nfe)


# ----------------------------------------------------------------------------------------------------------------
#                                                   Command
# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m generation.likelihood", description=__doc__)
    add = parser.add_argument
    add("--ckpt", required=True, help="a SiT export, checkpoint or run folder, official .pt or hub id (as sample.py)")
    add(
        "--images",
        type=Path,
        required=True,
        help="an .npz of uint8 images arr_0 (N, H, W, 3), labels arr_1 (as sample.py writes), or a folder of image "
        "files (as python -m fid reads one; with --label)",
    )
    add("--num-images", type=int, help="the first N images (default: all)")
    add("--label", help="every image's class K, or 'null' for the unconditional density (default: arr_1)")
    add("--dequantization", choices=DEQUANTIZATIONS, default="uniform", help="pixel-space models (default uniform)")
    add("--divergence", choices=("hutchinson", "exact"), default="hutchinson", help="exact: one backward per dim")
    add("--atol", type=float, default=DEFAULT_ATOL, help="dopri5's absolute tolerance (default %(default)g)")
    add("--rtol", type=float, default=DEFAULT_RTOL, help="dopri5's relative tolerance (default %(default)g)")
    add("--seed", type=int, default=0, help="of the dequantisation noise and the Hutchinson probes")
    add("--batch-size", type=int, default=16, help="images per ODE solve (default 16)")
    add("--vae", help="VAE hub id or local folder; overrides the export's (latent models)")
    add("--device", help="torch device (default: cuda when available)")
    add("--json", type=Path, help="write the figures (mean, per image, what they include) to this file")
    return parser


def check_args(args: argparse.Namespace) -> None:
    for name in ("num_images", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise LikelihoodError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("atol", "rtol"):
        if not getattr(args, name) > 0:
            raise LikelihoodError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.seed < 0:
        raise LikelihoodError(f"--seed must be >= 0, got {args.seed}")
    if args.device is not None:
        check_device(args.device)
    if args.json is not None:
        if args.json.resolve() == args.images.resolve():
            raise LikelihoodError(f"--json {args.json} is --images itself; choose another file")
        refuse_foreign(
            args.json,
            lambda path: json_object_with(path, REPORT_KEYS),
            "python -m generation.likelihood",
            subject=f"--json {args.json}",
        )
        check_writable(args.json.parent)


def read_images(args: argparse.Namespace, description: ExportDescription) -> tuple[Any, int, np.ndarray]:
    """The image reader of --images, how many of its images to take (--num-images) and their labels, checked
    against the model: size, gray images for a one-channel model (all read once), classes."""
    from fid.errors import InputError
    from fid.inputs import FolderImages, NpzImages

    if args.images.is_dir() and args.label is None:
        raise LikelihoodError(
            f"--images {args.images}: a folder of images has no labels; give --label K or --label null"
        )
    try:
        images = FolderImages(args.images) if args.images.is_dir() else NpzImages(args.images)
    except (InputError, OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise LikelihoodError(f"--images {args.images}: {unreadable(error)}") from None
    count = min(len(images), args.num_images or len(images))
    size = next(images.batches(1)).shape[1:3]  # an .npz or a folder: one image read
    if size != (description.image_size, description.image_size):
        raise LikelihoodError(
            f"--images {args.images}: {size[0]}x{size[1]} images; the model takes {description.image_size} px"
        )
    if description.channels == 1 and not all(
        (batch == batch[..., :1]).all() for batch, _ in image_batches(images, count, np.zeros(count, np.int64), 256)
    ):
        raise LikelihoodError(f"--images {args.images}: colour images, but the model takes one channel (gray)")
    classes = description.num_classes
    if args.label is None:
        try:
            with np.load(args.images) as data:
                labels = data["arr_1"][:count].astype(np.int64) if "arr_1" in data.files else None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            raise LikelihoodError(f"--images {args.images}: labels arr_1 {unreadable(error)}") from None
        if labels is None:
            raise LikelihoodError(f"--images {args.images}: no labels arr_1; give --label K or --label null")
    elif args.label == "null":
        if not description.has_null_class:
            raise LikelihoodError("--label null: the model was trained without label dropout (no null class)")
        return images, count, np.full(count, classes, np.int64)  # the null class
    else:
        try:
            labels = np.full(count, int(args.label), np.int64)
        except ValueError:
            raise LikelihoodError(f"--label {args.label!r}: expected a class index or null") from None
    if len(labels) < count or labels.min(initial=0) < 0 or labels.max(initial=0) >= classes:
        where = f"--label {args.label}" if args.label is not None else f"arr_1 of {args.images}"
        raise LikelihoodError(
            f"{where}: expected {count} class indices in 0..{classes - 1}, got {len(labels)} in "
            f"{labels.min(initial=0)}..{labels.max(initial=0)}"
        )
    return images, count, labels


def unreadable(error: BaseException) -> str:
    """What an .npz that cannot be read is, for the one line: a cut or damaged file (zip's, numpy's errors) or what
    fid's reader found wrong."""
    if isinstance(error, (zipfile.BadZipFile, EOFError)) or "pickled" in str(error):
        return f"cannot be read as an .npz ({type(error).__name__}: {error}); the file is cut or damaged"
    return str(error)


def image_batches(images, count: int, labels: np.ndarray, batch_size: int):
    """(images (B, H, W, 3), labels (B,)) batches of the first `count` images."""
    start = 0
    for batch in images.batches(batch_size):
        batch = batch[: count - start]
        yield batch, labels[start : start + len(batch)]
        start += len(batch)
        if start >= count:
            return


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    args = build_parser().parse_args(argv)
    check_args(args)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:  # under a launcher: the work is done once, by rank 0, not by every process
        if launch_rank() != "0":
            return None
        print(f"warning: {processes} processes launched; the likelihood runs in one process, rank 0 (the others exit)")
    from generation import ExportError, load_export
    from generation.official import OfficialCheckpointError

    try:
        export = load_export(args.ckpt)
    except (ExportError, OfficialCheckpointError) as error:
        raise LikelihoodError(f"--ckpt: {error}") from None
    description = export.description
    if description.objective.kind != "transport":
        raise LikelihoodError(
            f"--ckpt {args.ckpt}: a {description.objective.kind} model; the ODE likelihood needs an interpolant "
            "(SiT) model"
        )
    if args.vae is not None and description.in_pixel_space:
        raise LikelihoodError(f"--vae {args.vae}: the model of {args.ckpt} works in pixel space and uses no VAE")
    images, count, labels = read_images(args, description)

    import torch

    from generation.generator import check_vae_fits, load_model
    from generation.objective_builder import create_objective

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    vae = None
    if not description.in_pixel_space:
        from generation.vae import load_vae

        vae = load_vae(args.vae or description.vae, device, None if args.vae else description.vae_path, "--vae")
        check_vae_fits(vae, description, args.vae or description.vae, "--vae")  # channels and downsampling
    normalization = None if description.in_pixel_space else description.latent_normalization
    space = ModelSpace(description.channels, vae, normalization, args.dequantization)
    model, batches = load_model(export, device), image_batches(images, count, labels, args.batch_size)
    solver = dict(seed=args.seed, device=device, divergence=args.divergence, atol=args.atol, rtol=args.rtol)
    try:
        result = bits_per_dim(model, create_objective(description.objective), batches, space, **solver, progress=True)
    except AssertionError as error:  # torchdiffeq's adaptive solver: the step size fell to nothing (or NaN)
        if "underflow in dt" not in str(error):
            raise
        raise LikelihoodError(
            f"--ckpt {args.ckpt}: dopri5 cannot solve this model's probability-flow ODE at --atol {args.atol:g} "
            f"--rtol {args.rtol:g} (torchdiffeq: {error}): the model's velocity is not finite, or too steep, on "
            f"these images; an export of an earlier checkpoint, or looser tolerances, may solve"
        ) from None
    error = "" if result.standard_error is None else f" ± {result.standard_error:.4f}"
    print(f"bits/dim {result.mean:.4f}{error} (mean ± standard error over {count} images, D = {result.dims})")
    print(f"includes: {result.includes}")
    model_space = {}
    if space.latent:
        model_space = {"model_space_bits_per_dim": float(result.model_space_bits.mean())}
        print(f"model space (the latents the flow integrates from): {model_space['model_space_bits_per_dim']:.4f}")
    report = {
        "bits_per_dim": result.mean,
        "standard_error": result.standard_error,
        **model_space,
        "dims": result.dims,
        "includes": result.includes,
        "per_image": result.bits.tolist(),
        "log_prob_nats": result.log_prob.tolist(),
        "nfe": result.nfe,
        "settings": {
            key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items() if key != "debug"
        },
    }
    if args.json is not None:
        write_json_atomic(args.json, report)
    return report


def command() -> None:
    run_command(main)


if __name__ == "__main__":
    command()
