"""Sample a trained DiT or SiT into an ADM-style `.npz` batch for FID evaluation.

    accelerate launch sample.py --ckpt results/<run>/checkpoints/step-0400000/export \\
        --num-samples 50000 --out samples/run-400k-cfg1.5.npz --cfg-scale 1.5
    python sample.py --ckpt DiT-XL-2-256x256.pt --model DiT-XL/2 --num-samples 64 --out xl.npz

Writes `<out>.npz` with `arr_0`, uint8 images (N, H, W, 3), and `arr_1`, int64 labels (N,), the
layout the ADM evaluator and `python -m fid` read; a preview grid `<out>.png`; and `<out>.json`,
the settings and speed of the run.

Conventions:
- Labels: "balanced" gives sample i the label i % num_classes, so every prefix of a multiple of
  num_classes samples is exactly class-balanced; "uniform" draws them i.i.d. from --seed.
- Noise: sample i draws its initial and step noise from its own stream, seeded from (--seed, i), so
  the file does not depend on the number of processes. It does not depend on the batch size either,
  up to float rounding, except for adaptive ODE solvers, whose step sizes are shared by a batch.
- Pixels: uint8 = floor(clamp(127.5 x + 128, 0, 255)) for x in [-1, 1] (DiT's convention: (x + 1)
  * 127.5 rounded half up; a stored uint8 value k, read as x = k / 127.5 - 1, maps back to k).
  One-channel (pixel-space) images are repeated to three channels.
- Resuming: indices are cut into shards of --shard-size (independent of the number of processes);
  processes take the unfinished shards in turn and write each one atomically to `<out>.shards/`.
  Rerunning the same command after a crash or preemption keeps the finished shards; the main
  process merges them into `<out>.npz` once all are done and removes the shard folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from atomic_files import atomic_output, save_npz_atomic, write_text_atomic
from training.images import save_grid, to_uint8

LABEL_MODES = ("balanced", "uniform")
RUN_RECORD = "run.json"  # settings of the run whose shards a shard folder holds
SAMPLER_OPTIONS = ("eta", "clip_denoised", "atol", "rtol", "diffusion_form", "diffusion_norm", "last_step",
                   "last_step_size")  # command-line options passed on to `objective.sample` when set


# ----------------------------------------------------------------------------------------------
#                                       Command line
# ----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Sample a DiT/SiT checkpoint into an ADM-style .npz (arr_0 uint8 NHWC, arr_1 labels).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_argument_group("checkpoint")
    source.add_argument("--ckpt", type=Path, required=True,
                        help="export folder of a run (config.json + ema.safetensors), a checkpoint "
                             "step folder holding one, or an official DiT/SiT .pt state dict")
    source.add_argument("--model", default=None,
                        help="architecture of an official .pt checkpoint, e.g. DiT-XL/2 or SiT-XL/2")
    source.add_argument("--image-size", type=int, default=256, choices=(256, 512),
                        help="image size of an official .pt checkpoint")
    source.add_argument("--vae", default=None,
                        help="VAE hub id or local folder; overrides the checkpoint's (official "
                             "checkpoints default to the VAE of configs/imagenet256.yaml)")

    output = parser.add_argument_group("output")
    output.add_argument("--num-samples", type=int, required=True)
    output.add_argument("--out", type=Path, required=True, help="output .npz file")
    output.add_argument("--labels", choices=LABEL_MODES, default="balanced")
    output.add_argument("--seed", type=int, default=0)
    output.add_argument("--per-proc-batch-size", type=int, default=32)
    output.add_argument("--shard-size", type=int, default=256,
                        help="samples per resumable shard file; keep num-samples / shard-size "
                             "above the number of processes")
    output.add_argument("--grid-size", type=int, default=64,
                        help="number of leading samples shown in the preview PNG (0: none)")

    sampling = parser.add_argument_group("sampler")
    sampling.add_argument("--sampler", default=None,
                          help="sampler name; default: the objective's (DiT: ddpm, SiT: dopri5)")
    sampling.add_argument("--steps", type=int, default=None,
                          help="number of sampling steps; default: the sampler's")
    sampling.add_argument("--eta", type=float, default=None, help="DDIM eta")
    sampling.add_argument("--clip-denoised", action="store_const", const=True, default=None,
                          help="DDPM/DDIM: clamp the predicted x_0 to [-1, 1] (pixel-space models)")
    sampling.add_argument("--atol", type=float, default=None, help="adaptive ODE solver atol")
    sampling.add_argument("--rtol", type=float, default=None, help="adaptive ODE solver rtol")
    sampling.add_argument("--diffusion-form", default=None, help="SDE diffusion coefficient form")
    sampling.add_argument("--diffusion-norm", type=float, default=None, help="SDE diffusion scale")
    sampling.add_argument("--last-step", default=None, help="SDE last step type")
    sampling.add_argument("--last-step-size", type=float, default=None, help="SDE last step size")

    guidance = parser.add_argument_group("classifier-free guidance")
    guidance.add_argument("--cfg-scale", type=float, default=1.0, help="1: no guidance")
    guidance.add_argument("--guidance-channels", type=int, default=None,
                          help="guide only the first k prediction channels (3 reproduces DiT/SiT)")
    guidance.add_argument("--guidance-interval", type=float, nargs=2, default=None,
                          metavar=("LO", "HI"),
                          help="guide only for times in [LO, HI], in the model's own time units "
                               "(DDPM: timestep 0..999; SiT: 0 = noise .. 1 = data)")

    runtime = parser.add_argument_group("runtime")
    runtime.add_argument("--cpu", action="store_true",
                         help="run on CPU processes (needed for torchrun on a machine without GPUs)")
    runtime.add_argument("--progress", action="store_true",
                         help="also show a progress bar over the sampler's steps")
    return parser


def sampler_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sampler options set on the command line, as keyword arguments of `objective.sample`."""
    return {name: getattr(args, name) for name in SAMPLER_OPTIONS if getattr(args, name) is not None}


def check_args(args: argparse.Namespace) -> None:
    """Reject arguments that cannot work, before any model, VAE or process group is built."""
    if not args.ckpt.exists():
        raise SystemExit(f"--ckpt {args.ckpt}: no such file or folder")
    if args.ckpt.is_file() and args.model is None:
        raise SystemExit(f"--ckpt {args.ckpt} is a state-dict file: name its architecture with "
                         f"--model (e.g. DiT-XL/2 or SiT-XL/2)")
    if args.ckpt.is_dir() and args.model is not None:
        raise SystemExit(f"--model {args.model}: an export folder ({args.ckpt}) names its own model; "
                         f"--model is only for official .pt checkpoints")
    for name in ("num_samples", "per_proc_batch_size", "shard_size"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.grid_size < 0:
        raise SystemExit(f"--grid-size must be >= 0, got {args.grid_size}")
    if args.steps is not None and args.steps <= 0:
        raise SystemExit(f"--steps must be positive, got {args.steps}")
    if not math.isfinite(args.cfg_scale) or args.cfg_scale < 0:
        raise SystemExit(f"--cfg-scale must be a finite number >= 0, got {args.cfg_scale}")
    if args.guidance_channels is not None and args.guidance_channels <= 0:
        raise SystemExit(f"--guidance-channels must be positive, got {args.guidance_channels}")
    if args.guidance_interval is not None:
        low, high = args.guidance_interval
        if not low < high:
            raise SystemExit(f"--guidance-interval {low} {high}: expected LO < HI")
    if args.out.suffix != ".npz":
        raise SystemExit(f"--out {args.out}: expected a file name ending in .npz")
    if not args.out.parent.exists():
        raise SystemExit(f"--out {args.out}: folder {args.out.parent} does not exist")


def run_record(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting that changes the output: shards of one run must never be mixed with another's."""
    return {
        "ckpt": str(args.ckpt.resolve()), "model": args.model, "image_size": args.image_size,
        "vae": args.vae, "num_samples": args.num_samples, "labels": args.labels, "seed": args.seed,
        "per_proc_batch_size": args.per_proc_batch_size, "shard_size": args.shard_size,
        "sampler": args.sampler, "steps": args.steps, "sampler_options": sampler_options(args),
        "cfg_scale": args.cfg_scale, "guidance_channels": args.guidance_channels,
        "guidance_interval": args.guidance_interval,
    }


def check_record(stored: dict[str, Any], record: dict[str, Any], source: Path) -> None:
    """Fail, naming the first differing setting, when `source` was written by another run."""
    for key in [*record, *(stored.keys() - record.keys())]:
        if stored.get(key) != record.get(key):
            raise SystemExit(f"{source} belongs to a run with {key}={stored.get(key)!r}, not "
                             f"{record.get(key)!r}: remove it or choose another --out")


# ----------------------------------------------------------------------------------------------
#                                    Labels and noise seeds
# ----------------------------------------------------------------------------------------------

def assign_labels(num_samples: int, num_classes: int, mode: str, seed: int) -> np.ndarray:
    """Class label of every sample index, (N,) int64; the same on every process."""
    if mode == "balanced":
        return np.arange(num_samples, dtype=np.int64) % num_classes
    if mode == "uniform":
        return np.random.default_rng(seed).integers(0, num_classes, num_samples, dtype=np.int64)
    raise ValueError(f"label mode {mode!r}: expected one of {LABEL_MODES}")


def sample_seeds(seed: int, indices: Sequence[int]) -> list[int]:
    """One 63-bit noise seed per sample index, a hash of (seed, index) (no collisions in practice)."""
    return [int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)
            for index in indices]


# ----------------------------------------------------------------------------------------------
#                                  Shards: plan, write, merge
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shard:
    """Sample indices [start, stop), stored as one file once finished."""

    number: int
    start: int
    stop: int

    @property
    def file_name(self) -> str:
        return f"shard-{self.number:06d}.npz"


def plan_shards(num_samples: int, shard_size: int) -> list[Shard]:
    """Cut the indices 0..N-1 into consecutive shards of `shard_size` (the last one may be smaller)."""
    return [Shard(number, start, min(start + shard_size, num_samples))
            for number, start in enumerate(range(0, num_samples, shard_size))]


def shard_folder(out: Path) -> Path:
    return out.with_name(out.name + ".shards")


def load_shard(folder: Path, shard: Shard, labels: np.ndarray) -> np.ndarray:
    """Images of a finished shard, (n, H, W, 3) uint8, after checking its indices and labels."""
    path = folder / shard.file_name
    with np.load(path) as data:
        images, shard_labels, indices = data["arr_0"], data["arr_1"], data["index"]
    expected = np.arange(shard.start, shard.stop)
    if (images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3
            or len(images) != len(expected) or not np.array_equal(indices, expected)
            or not np.array_equal(shard_labels, labels[shard.start:shard.stop])):
        raise RuntimeError(f"{path} does not hold samples {shard.start}..{shard.stop - 1} of this "
                           f"run: remove it and rerun to sample it again")
    return images


def merge_shards(folder: Path, shards: Sequence[Shard], labels: np.ndarray, out: Path) -> None:
    """Stream all shards, in index order, into `out` (arr_0 images, arr_1 labels), atomically.

    np.savez needs the whole array in memory (39 GB for 50 000 images at 512 px), so the .npz
    (a zip of .npy files) is written member by member, one shard at a time.
    """
    first = load_shard(folder, shards[0], labels)
    shape = (len(labels), *first.shape[1:])
    with atomic_output(out) as temporary, zipfile.ZipFile(temporary, "w", allowZip64=True) as archive:
        with archive.open("arr_0.npy", "w", force_zip64=True) as member:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                      "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_1_0(member, header)
            member.write(first.tobytes())
            for shard in shards[1:]:
                images = load_shard(folder, shard, labels)
                if images.shape[1:] != shape[1:]:
                    raise RuntimeError(f"{folder / shard.file_name}: images of shape "
                                       f"{images.shape[1:]}, expected {shape[1:]}")
                member.write(images.tobytes())
        with archive.open("arr_1.npy", "w") as member:
            np.lib.format.write_array(member, labels)


def leading_images(folder: Path, shards: Sequence[Shard], labels: np.ndarray, count: int) -> np.ndarray:
    """The first `count` samples, (count, H, W, 3) uint8, read from the leading shards (for the preview)."""
    images, total = [], 0
    for shard in shards:
        if total >= count:
            break
        images.append(load_shard(folder, shard, labels)[:count - total])
        total += len(images[-1])
    return np.concatenate(images)


def summary_path(out: Path) -> Path:
    return out.with_suffix(".json")


def already_finished(out: Path, record: dict[str, Any]) -> bool:
    """True when `out` was written by this very run; an `out` of any other run is an error."""
    if not out.exists():
        return False
    summary = summary_path(out)
    if not summary.exists():
        raise SystemExit(f"--out {out} exists and was not written by sample.py (no {summary.name}): "
                         f"remove it or choose another --out")
    check_record(json.loads(summary.read_text())["settings"], record, summary)
    return True


def claim_pending_shards(accelerator, folder: Path, shards: Sequence[Shard],
                         record: dict[str, Any]) -> list[Shard]:
    """The shards still to sample, as the main process sees them, identical on every process.

    The main process checks (or writes) the folder's run record and lists the finished shard files
    before any process writes one, then broadcasts the list, so all processes split the same work.
    """
    from accelerate.utils import broadcast_object_list

    message: list[Any] = [None, None]  # (pending shards, error)
    if accelerator.is_main_process:
        try:
            folder.mkdir(exist_ok=True)
            record_path = folder / RUN_RECORD
            pending = [shard for shard in shards if not (folder / shard.file_name).exists()]
            if len(pending) == len(shards):  # nothing finished yet, so nothing to protect
                write_text_atomic(record_path, json.dumps(record, indent=2))
            elif not record_path.exists():
                raise SystemExit(f"{folder} holds shards but no {RUN_RECORD} naming their run: remove it")
            else:
                check_record(json.loads(record_path.read_text()), record, record_path)
            message[0] = pending
        except (OSError, SystemExit) as error:
            message[1] = str(error)
    broadcast_object_list(message)
    pending, error = message
    if error is not None:
        raise SystemExit(error)
    return pending


# ----------------------------------------------------------------------------------------------
#                                 Generator: model, objective, decoder
# ----------------------------------------------------------------------------------------------

# The recipe the official DiT/SiT checkpoints were trained with: VAE, latent scale, classes, image size.
OFFICIAL_RECIPE = Path(__file__).resolve().parent / "configs" / "imagenet256.yaml"


@dataclass(frozen=True)
class CheckpointSpec:
    """What a checkpoint holds, read without loading weights, so arguments are checked up front."""

    objective: Any  # dit_vca.GaussianDiffusion or sit_vca.Transport (cheap to build)
    num_classes: int
    channels: int  # prediction channels (model.in_channels)
    has_null_class: bool  # trained with label dropout, so classifier-free guidance is possible
    vae: str | None  # hub id or folder; None for pixel-space models
    latent_scale: float | None
    export: Path | None  # export folder; None for an official state-dict file


def read_spec(args: argparse.Namespace) -> CheckpointSpec:
    """Describe --ckpt from its export's config.json, or from --model for an official checkpoint."""
    from training.build import create_objective
    from training.checkpoint import EXPORT_CONFIG, find_export

    if args.ckpt.is_file():
        return read_official_spec(args)
    try:
        folder = find_export(args.ckpt)
    except FileNotFoundError as error:
        raise SystemExit(f"--ckpt: {error}") from None
    description = json.loads((folder / EXPORT_CONFIG).read_text())
    model, data = description["model"], description["data"]
    pixels = data["kind"] == "pixels"
    if pixels and args.vae is not None:
        raise SystemExit(f"--vae {args.vae}: the model of {folder} works in pixel space and uses no VAE")
    return CheckpointSpec(
        objective=create_objective(description["objective"]), num_classes=model["num_classes"],
        channels=model["in_channels"], has_null_class=model["class_dropout_prob"] > 0,
        vae=None if pixels else args.vae or data["vae"], latent_scale=data["latent_scale"], export=folder)


def read_official_spec(args: argparse.Namespace) -> CheckpointSpec:
    """An official checkpoint: DDPM (DiT) or linear-path velocity transport (SiT), official recipe's VAE."""
    import yaml

    from dit_vca.models import model_names
    from training.build import OBJECTIVE_OF_FAMILY, create_objective
    from training.vae import SD_VAE_ARCHITECTURE

    family = args.model.split("-", 1)[0]
    if family not in OBJECTIVE_OF_FAMILY or args.model not in model_names(family):
        valid = [name for family in OBJECTIVE_OF_FAMILY for name in model_names(family)]
        raise SystemExit(f"--model {args.model!r}: expected one of {', '.join(valid)}")
    recipe = yaml.safe_load(OFFICIAL_RECIPE.read_text())
    return CheckpointSpec(
        objective=create_objective({"kind": OBJECTIVE_OF_FAMILY[family]}),
        num_classes=recipe["data"]["num_classes"], channels=SD_VAE_ARCHITECTURE["latent_channels"],
        has_null_class=True, vae=args.vae or recipe["vae"]["name"], latent_scale=recipe["vae"]["scale"],
        export=None)


def check_args_against(spec: CheckpointSpec, args: argparse.Namespace) -> None:
    """Reject sampler and guidance settings that the checkpoint cannot serve."""
    names = spec.objective.sampler_names
    if args.sampler is not None and args.sampler not in names:
        raise SystemExit(f"--sampler {args.sampler!r}: this checkpoint's objective offers {', '.join(names)}")
    if args.cfg_scale != 1 and not spec.has_null_class:
        raise SystemExit(f"--cfg-scale {args.cfg_scale}: the model was trained without label dropout, so it "
                         f"has no null class for classifier-free guidance")
    if args.guidance_channels is not None and args.guidance_channels > spec.channels:
        raise SystemExit(f"--guidance-channels {args.guidance_channels}: the model predicts only "
                         f"{spec.channels} channels")


@dataclass
class Generator:
    """A model, its objective and the map from model space to pixels, whatever the checkpoint's origin."""

    model: torch.nn.Module
    objective: Any
    decode: Callable[[torch.Tensor], torch.Tensor]  # model space (B, C, h, w) -> pixels in [-1, 1]
    num_classes: int

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return (self.model.in_channels, self.model.input_size, self.model.input_size)


def load_generator(spec: CheckpointSpec, args: argparse.Namespace, device: torch.device) -> Generator:
    """Load weights (EMA of an export, or an official state dict into the MHSA baseline) and the VAE."""
    vae = None
    if spec.vae is not None:
        from training.vae import load_vae  # diffusers is slow to import: only for latent models

        vae = load_vae(spec.vae, device)  # first: fails fast when offline without a local copy
    if spec.export is not None:
        from training.checkpoint import load_export

        model, objective, _ = load_export(spec.export, device)
    else:
        model, objective = load_official(spec, args, vae).to(device), spec.objective

    def decode(x: torch.Tensor) -> torch.Tensor:
        if vae is None:
            return x  # pixel-space models produce images in [-1, 1] directly
        from training.vae import decode_latents

        return decode_latents(vae, x, spec.latent_scale)

    return Generator(model, objective, decode, spec.num_classes)


def load_official(spec: CheckpointSpec, args: argparse.Namespace, vae: torch.nn.Module) -> torch.nn.Module:
    """An official DiT/SiT state dict (plain, or a training checkpoint's "ema") in the MHSA baseline."""
    from dit_vca.models import build_model_from_config
    from training.vae import latent_downsampling

    model = build_model_from_config({
        "name": args.model, "attention": "mhsa", "num_classes": spec.num_classes,
        "in_channels": spec.channels, "input_size": args.image_size // latent_downsampling(vae.config)})
    try:
        state = torch.load(args.ckpt, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise SystemExit(f"--ckpt {args.ckpt} is not a plain state dict (read with weights_only=True): "
                         f"{error}") from None
    state = state.get("ema", state)  # DiT/SiT training checkpoints keep the EMA weights under "ema"
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise SystemExit(f"--ckpt {args.ckpt} does not fit --model {args.model} at --image-size "
                         f"{args.image_size}: {error}") from None
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------
#                                           Sampling
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def sample_images(generator: Generator, labels: np.ndarray, seeds: Sequence[int],
                  args: argparse.Namespace) -> tuple[np.ndarray, int]:
    """One batch: (B, H, W, 3) uint8 images for `labels` (B,), one noise seed each, and the sampler's NFE."""
    from samplers import PerSampleNoise, classifier_free_guidance

    device = next(generator.model.parameters()).device
    noise = PerSampleNoise(seeds, device)
    x_T = noise(generator.sample_shape)  # (B, C, h, w), the first draw of every sample's stream
    model_fn = classifier_free_guidance(
        generator.model, args.cfg_scale, null_label=generator.num_classes,
        guided_channels=args.guidance_channels,
        interval=None if args.guidance_interval is None else tuple(args.guidance_interval),
    )
    result = generator.objective.sample(
        model_fn, x_T, torch.as_tensor(labels, device=device),
        sampler=args.sampler or generator.objective.default_sampler, steps=args.steps, noise=noise,
        progress=args.progress, **sampler_options(args),
    )
    return to_uint8(generator.decode(result.samples)), result.nfe


def sample_shards(generator: Generator, shards: Sequence[Shard], labels: np.ndarray, folder: Path,
                  args: argparse.Namespace, show_progress: bool) -> list[int]:
    """Sample `shards` batch by batch and write each finished one atomically; returns the NFE per batch."""
    from tqdm import tqdm

    nfes = []
    total = sum(shard.stop - shard.start for shard in shards)
    with tqdm(total=total, unit="img", disable=not show_progress, desc="sampling") as bar:
        for shard in shards:
            batches = []
            for start in range(shard.start, shard.stop, args.per_proc_batch_size):
                indices = range(start, min(start + args.per_proc_batch_size, shard.stop))
                images, nfe = sample_images(generator, labels[indices.start:indices.stop],
                                            sample_seeds(args.seed, indices), args)
                batches.append(images)
                nfes.append(nfe)
                bar.update(len(indices))
            save_npz_atomic(folder / shard.file_name, arr_0=np.concatenate(batches),
                            arr_1=labels[shard.start:shard.stop], index=np.arange(shard.start, shard.stop))
    return nfes


# ----------------------------------------------------------------------------------------------
#                                             Main
# ----------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> None:
    """Check the arguments, claim the unfinished shards, sample them, and (main process) merge."""
    args = build_parser().parse_args(argv)
    check_args(args)
    record = run_record(args)
    if already_finished(args.out, record):
        print(f"sample.py: {args.out} is already complete")
        return
    spec = read_spec(args)
    check_args_against(spec, args)

    from accelerate import Accelerator
    from accelerate.utils import gather_object

    accelerator = Accelerator(cpu=args.cpu)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes == 1 and launched > 1:  # each process would sample everything alone
        raise SystemExit(f"launched {launched} processes but Accelerate sees one: on a machine without "
                         f"GPUs pass --cpu")
    labels = assign_labels(args.num_samples, spec.num_classes, args.labels, args.seed)
    shards = plan_shards(args.num_samples, args.shard_size)
    folder = shard_folder(args.out)
    pending = claim_pending_shards(accelerator, folder, shards, record)
    mine = pending[accelerator.process_index::accelerator.num_processes]
    if accelerator.is_main_process and len(pending) < len(shards):
        print(f"sample.py: resuming, {len(shards) - len(pending)} of {len(shards)} shards already in {folder}")

    generator = load_generator(spec, args, accelerator.device)
    started = time.perf_counter()
    nfes = sample_shards(generator, mine, labels, folder, args, show_progress=accelerator.is_main_process)
    per_process = gather_object([sum(shard.stop - shard.start for shard in mine)])  # also a barrier
    seconds = time.perf_counter() - started
    if not accelerator.is_main_process:
        return

    new_images = sum(per_process)
    summary = {"settings": record, "processes": accelerator.num_processes, "new_images": new_images,
               "images_per_process": per_process,
               "seconds": round(seconds, 3), "images_per_second": round(new_images / seconds, 3),
               "main_process_mean_nfe_per_batch": float(np.mean(nfes)) if nfes else None,
               "model": generator.model.config}
    finish(args.out, folder, shards, labels, summary, args.grid_size)
    print(f"sample.py: {new_images} images in {seconds:.1f} s ({new_images / seconds:.2f} images/s on "
          f"{accelerator.num_processes} process(es)); wrote {args.out} ({args.num_samples} samples)")


def finish(out: Path, folder: Path, shards: Sequence[Shard], labels: np.ndarray, summary: dict[str, Any],
           grid_size: int) -> None:
    """Write the summary, the preview grid and the merged .npz (last, so that it implies the other two),
    then drop the shards."""
    write_text_atomic(summary_path(out), json.dumps(summary, indent=2))
    if grid_size:
        save_grid(leading_images(folder, shards, labels, grid_size), out.with_suffix(".png"))
    merge_shards(folder, shards, labels, out)
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
