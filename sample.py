"""Sample a trained DiT or SiT into an ADM-style `.npz` batch for FID evaluation.

    accelerate launch sample.py --ckpt results/<run>/checkpoints/step-0400000/export \\
        --num-samples 50000 --out samples/run-400k-cfg1.5.npz --cfg-scale 1.5
    python sample.py --ckpt DiT-XL-2-256x256.pt --num-samples 64 --out xl.npz     # downloaded once, converted
    python sample.py --ckpt DiT-XL-2-256x256.pt --protocol dit --num-samples 50000 --out dit.npz  # FID 2.27

`--ckpt` is an export folder, a checkpoint or run folder, an official DiT/SiT `.pt` (a path, or the bare name of a
released one), or a Hugging Face Hub id of an export. Writes `<out>.npz` (`arr_0` uint8 (N, H, W, 3), `arr_1`
int64 labels), a preview grid `<out>.png` (one labelled row per class, the guidance in its title) and `<out>.json`
(settings and speed), never replacing files that an earlier sample.py run with other settings (unless
--overwrite), or anything else, wrote. The settings name the sha256 of the weights file (`weights_sha256`): an
export replaced in place is another run's, never resumed nor "already complete". Given a run or checkpoint
folder, the newest export in it is used; the command prints it, and `<out>.json` records it with its training step
(`export`, `train_step`). `--protocol NAME` (listed below) sets what the official evaluations used
(generation/protocols.py); flags given explicitly win, and `<out>.json` records the protocol with the resolved
settings. `--guide-ckpt PATH --guidance-scale W` guides with a weaker model of the same objective, inputs and classes
instead of the null class (autoguidance, D = D_guide + W (D_main - D_guide)) on the channels and interval of
--guidance-channels / --guidance-interval; the guide is checked against the model before anything is written.

Sample i gets label i % num_classes ("balanced") or a seeded draw ("uniform") and draws all its noise from its
own stream seeded by (--seed, i), so the file depends neither on the number of processes nor (up to float
rounding, and except for adaptive ODE solvers) on the batch size. Indices are cut into shards of --shard-size,
written atomically to `<out>.shards/`; rerunning the same command after a crash keeps the finished shards. The
shards and the merged .npz are all on the disk until the merge ends (about twice N x H x W x 3 bytes): a run that
cannot fit there is refused once the checkpoint's description is read, before the model is built.
Pixels: uint8 = floor(clamp(127.5 x + 128, 0, 255)) (DiT's rounding); one-channel images are repeated to RGB.
A bad argument or a damaged checkpoint stops the command with one line and exit status 2 before anything is
written (`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from atomic_files import allocation_unit, free_bytes, write_json_atomic
from atomic_files.shards import ShardFolder, ShardFolderError
from commands import UserError, check_launched_processes, end_processes, run_command
from generation.sample_file import (
    DamagedShardError,
    SampleFiles,
    Shard,
    ShardPlan,
    images_at,
    merge_shards,
    plan_shards,
    run_bytes,
    save_shard,
    shard_reader,
)
from generation.sample_plan import SampleLabels, sample_seeds
from objectives import SAMPLER_OPTIONS
from sample_arguments import SampleError, check_against, check_args, describe_protocol, parse_args


def main(argv: Sequence[str] | None = None) -> None:
    """Parse, check, load, sample the unfinished shards, and (main process) merge."""
    args = parse_args(argv, description=__doc__)
    check_args(args)
    settings = run_settings(args)
    files = SampleFiles(args.out)
    if files.claim(settings, overwrite=args.overwrite):
        print(f"sample.py: {args.out} is already complete")
        return
    export = load_checkpoint(args)  # nothing is written before the checkpoint has loaded
    check_against(export.description, args)
    check_disk_space(args, export.description.image_size, files)
    accelerator = create_accelerator(args)
    from generation.generator import default_precision, set_matmul_precision

    precision = args.precision or default_precision(accelerator.device, accelerator.mixed_precision)
    set_matmul_precision(precision)  # before any model is loaded: the Triton core is checked for it
    if args.guide_ckpt is not None:
        load_guide(args, export.description, accelerator.device, precision)
    if "export" in settings and accelerator.is_main_process:  # once per job (Accelerate's print: once per node)
        print(
            f"sample.py: --ckpt {args.ckpt}: using {settings['export']} (training step {export.description.train_step})"
        )
    if args.protocol and accelerator.is_main_process:
        print(describe_protocol(args))
    from generation import ImageGenerator

    labels = SampleLabels(args.num_samples, export.description.num_classes, args.labels, args.seed)  # lazily
    shards = plan_shards(args.num_samples, args.shard_size)  # lazily, as the labels
    try:
        generator = ImageGenerator.from_export(
            export,
            accelerator.device,
            vae=args.vae,
            precision=precision,
            compile=args.compile,
            vca_kernel=args.vca_kernel,
            vae_option="--vae",
        )  # model and VAE load before the folder is claimed
    except UserError:  # a VAE that cannot be loaded: its line names the VAE and --vae
        raise
    except ValueError as error:  # the backbone names what does not fit (a contrast grid that does not tile)
        raise SampleError(f"--ckpt {args.ckpt}: its description builds no model ({error})") from None
    try_sampler(generator, labels, args)
    if args.overwrite and accelerator.is_main_process:
        removed = files.remove_other_run(settings)
        if removed:
            print(
                f"sample.py: --overwrite: removed {', '.join(path.name for path in removed)} of a run with other "
                f"settings"
            )
    folder = ShardFolder(files.shards, shards.names, settings, replace_other_run=args.overwrite)
    try:
        pending = folder.claim(accelerator)  # shard numbers, ascending
    except ShardFolderError as error:
        raise SampleError(f"--out {args.out}: {error}") from None
    if accelerator.is_main_process and len(pending) < len(shards):
        print(f"sample.py: resuming, {len(shards) - len(pending)} of {len(shards)} shards already in {folder.folder}")

    mine = pending[accelerator.process_index :: accelerator.num_processes]
    started = time.perf_counter()
    sample_shards(generator, shards, mine, labels, folder, args, show_progress=accelerator.is_local_main_process)
    from accelerate.utils import gather_object

    per_process = gather_object([shards.samples_in(mine)])  # also a barrier
    seconds = time.perf_counter() - started
    # The process group ends on every process before the main one merges: a merge of 50K samples (9.8 GB at 256 px)
    # takes minutes, and processes waiting for it in a collective would be ended by its watchdog (NCCL: 10 min).
    end_processes(accelerator)  # and frees the group, which a module imported since would keep (its docstring)
    if accelerator.is_main_process:
        new_images = sum(per_process)
        summary = {
            "settings": settings,
            "precision": precision,
            "processes": accelerator.num_processes,
            "new_images": new_images,  # sampled by this launch; the others were kept from earlier ones
            "kept_images": args.num_samples - new_images,
            "images_per_process": per_process,
            "seconds": round(seconds, 3) if new_images else None,  # no sampling, no speed to report
            "images_per_second": round(new_images / seconds, 3) if new_images else None,
            "main_process_model_evaluations": generator.model_evaluations,
            "model": asdict(export.description.model),
            "source": export.description.source,
            "train_step": export.description.train_step,
            **({"guide": args.guide_description} if args.guide_ckpt is not None else {}),
        }
        if not new_images and files.summary.exists():  # a launch that only merges (the last one was killed in
            summary = None  # its merge): the summary of the launch that sampled, these settings', stays
        finish(args, folder, shards, labels, summary, generator)
        if new_images:
            print(
                f"sample.py: {new_images} images in {seconds:.1f} s ({new_images / seconds:.2f} images/s on "
                f"{accelerator.num_processes} process(es)); wrote {args.out} ({args.num_samples} samples)"
            )
        else:
            print(
                f"sample.py: all {args.num_samples} samples were sampled by an earlier launch; merged into {args.out}"
            )


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting that changes the output, the weights' sha256 among them: shards and files of one run are never
    mixed with another's, nor with those of other weights at the same path."""
    ckpt = Path(args.ckpt)
    protocol = {"protocol": args.protocol} if args.protocol else {}  # runs from before protocols keep matching
    export = resolved_export(ckpt)  # a run folder's newest export: a rerun after more training is another run
    newest = {"export": str(export)} if export is not None else {}
    return {
        **protocol,
        "ckpt": str(ckpt.resolve()) if ckpt.exists() else args.ckpt,
        **newest,
        "weights_sha256": weights_digest(args.ckpt, "--ckpt", args.model, args.image_size),
        "model": args.model,
        "image_size": args.image_size,
        "vae": args.vae,
        "num_samples": args.num_samples,
        "labels": args.labels,
        "seed": args.seed,
        "per_proc_batch_size": args.per_proc_batch_size,
        "shard_size": args.shard_size,
        **{key: value for key, value in generation_options(args).items() if key not in ("guidance_interval", "guide")},
        **autoguidance_settings(args),
        "guidance_interval": args.guidance_interval,
        "precision": args.precision,
        "compile": args.compile,
        **({"vca_kernel": args.vca_kernel} if args.vca_kernel != "auto" else {}),  # runs from before it keep matching
    }


def autoguidance_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The guide and its scale, when autoguiding (runs from before autoguidance keep matching)."""
    if args.guide_ckpt is None:
        return {}
    guide = Path(args.guide_ckpt)
    export = resolved_export(guide, "--guide-ckpt")
    return {
        "guide_ckpt": str(guide.resolve()) if guide.exists() else args.guide_ckpt,
        **({"guide_export": str(export)} if export is not None else {}),
        "guide_weights_sha256": weights_digest(args.guide_ckpt, "--guide-ckpt"),
        "guidance_scale": args.guidance_scale,
    }


def weights_digest(ckpt: str, option: str, model: str | None = None, image_size: int | None = None) -> str:
    """The sha256 of the weights file `option` (--ckpt, --guide-ckpt) names: what identifies the model behind a run's
    samples, so that an export replaced in place (same path, other weights) is another run's, never resumed or
    taken as complete."""
    from atomic_files.digest import file_sha256
    from generation import ExportError, weights_file
    from generation.official import OfficialCheckpointError

    try:
        return file_sha256(weights_file(ckpt, model, image_size))
    except (ExportError, OfficialCheckpointError) as error:
        raise SampleError(f"{option}: {error}") from None


def resolved_export(ckpt: Path, option: str = "--ckpt") -> Path | None:
    """The export folder that a run or checkpoint folder `option` (--ckpt, --guide-ckpt) stands for (a run's
    newest); None for an export folder itself, a file or a hub id."""
    from generation import ExportError
    from generation.export import EXPORT_CONFIG, find_export

    if not ckpt.is_dir() or (ckpt / EXPORT_CONFIG).is_file():
        return None
    try:
        return find_export(ckpt).resolve()
    except ExportError as error:
        raise SampleError(f"{option}: {error}") from None


def load_checkpoint(args: argparse.Namespace):
    """The export --ckpt names (official checkpoints are converted, hub ids fetched); user errors exit 2."""
    from generation import ExportError, load_export
    from generation.official import OfficialCheckpointError

    try:
        return load_export(args.ckpt, args.model, args.image_size)
    except (ExportError, OfficialCheckpointError) as error:
        raise SampleError(f"--ckpt: {error}") from None


def check_disk_space(args: argparse.Namespace, image_size: int, files: SampleFiles) -> None:
    """Refuse a run whose samples cannot fit on the disk of --out, before the model is built or the shard folder
    claimed: the shards and the merged .npz (`run_bytes`, about twice the images), the summary and the grid are all
    on it until the merge ends, each file taking whole allocation units, less what a resumed run's finished shards
    (or a run --overwrite replaces) hold already."""
    from generation.images import grid_bytes

    unit = allocation_unit(args.out.parent)
    grid = grid_bytes(min(args.grid_size, args.num_samples), image_size)
    needed = run_bytes(args.num_samples, image_size, args.shard_size, grid, unit) - files.bytes_on_disk(unit)
    free = free_bytes(args.out.parent)
    if needed > free:
        raise SampleError(
            f"--num-samples {args.num_samples}: {image_size}x{image_size} images need {needed:,} bytes on the disk "
            f"of {args.out.parent} (the shards and the merged .npz, both kept until the merge ends), but "
            f"{free:,} are free; free some space, choose another --out, or sample fewer"
        )


def create_accelerator(args: argparse.Namespace):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=args.cpu)
    check_launched_processes(accelerator.num_processes, "sample.py", "--cpu")
    return accelerator


def load_guide(args: argparse.Namespace, description, device, precision: str) -> None:
    """Load --guide-ckpt onto `device` as args.guide, after checking in one line that it can guide the model."""
    from generation import ExportError, load_export
    from generation.autoguide import guide_mismatch
    from generation.generator import load_model
    from generation.official import OfficialCheckpointError

    try:
        export = load_export(args.guide_ckpt)
    except (ExportError, OfficialCheckpointError) as error:
        raise SampleError(f"--guide-ckpt: {error}") from None
    mismatch = guide_mismatch(description, export.description)
    if mismatch is not None:
        name, ours, theirs = mismatch
        raise SampleError(
            f"--guide-ckpt {args.guide_ckpt}: its {name} is {theirs!r}, the model's is {ours!r}; a guide needs the "
            f"model's objective, inputs and classes"
        )
    args.guide = load_model(export, device, args.compile, args.vca_kernel, precision)
    args.guide_description = {"train_step": export.description.train_step, "source": export.description.source}


def try_sampler(generator, labels: SampleLabels, args: argparse.Namespace) -> None:
    """Draw sample 0 once with every option (sampler, steps, eta, tolerances, guidance, decoder), so that an option
    the sampler rejects, or a guidance scale too large for the model's float32 outputs (--cfg-scale 1e300: the
    guided prediction overflows), fails here, before the shard folder is claimed: the cost of one sample of N."""
    from samplers.interface import SamplerOptionError

    try:
        generator.generate(labels[:1], sample_seeds(args.seed, range(1)), **generation_options(args))
    except SamplerOptionError as error:  # the samplers' own check of each option, naming it
        raise SampleError(f"--sampler {args.sampler or 'default'} with these options: {error}") from None
    except FloatingPointError:  # generation.images.to_uint8: the images hold NaN or infinity
        flag, scale = ("--guidance-scale", args.guidance_scale) if args.guide else ("--cfg-scale", args.cfg_scale)
        if scale == 1:  # unguided: not an option's doing (the export's weights are checked finite)
            raise
        raise SampleError(
            f"{flag} {scale:g}: sample 0 comes out NaN or infinite at this scale; expected a scale at which the "
            f"guided prediction stays finite (DiT and SiT publish 1.5 for FID, 4 for pictures)"
        ) from None
    generator.model_evaluations = 0  # the summary counts the sampling work only


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of `ImageGenerator.generate` beyond labels and seeds."""
    options = {name: getattr(args, name) for name in SAMPLER_OPTIONS if getattr(args, name) is not None}
    interval = None if args.guidance_interval is None else tuple(args.guidance_interval)
    autoguided = {"guide": args.guide} if args.guide is not None else {}  # the network load_guide loaded
    return dict(
        guidance=args.cfg_scale if args.guide_ckpt is None else args.guidance_scale,
        **autoguided,
        sampler=args.sampler,
        steps=args.steps,
        guidance_channels=args.guidance_channels,
        guidance_interval=interval,
        **options,
    )


def sample_shards(
    generator,
    shards: ShardPlan,
    numbers: Sequence[int],
    labels: SampleLabels,
    folder: ShardFolder,
    args: argparse.Namespace,
    show_progress: bool,
) -> None:
    """Sample the shards `numbers` (ascending) of the plan and write each one atomically as soon as it is finished;
    the progress bar (per node: `show_progress` on each local main process) counts their samples."""
    from tqdm import tqdm

    with tqdm(total=shards.samples_in(numbers), unit="img", disable=not show_progress, desc="sampling") as bar:
        for number in numbers:
            shard = shards[number]
            images = sample_shard(generator, shard, labels, args, bar)
            folder.write(shard.number, lambda path, shard=shard, images=images: save_shard(path, shard, images, labels))


def sample_shard(generator, shard: Shard, labels: SampleLabels, args: argparse.Namespace, bar=None) -> np.ndarray:
    """(n, H, W, 3) uint8 images of one shard, batch by batch."""
    batches = []
    for start in range(shard.start, shard.stop, args.per_proc_batch_size):
        indices = range(start, min(start + args.per_proc_batch_size, shard.stop))
        batches.append(
            generator.generate(
                labels[indices.start : indices.stop],
                sample_seeds(args.seed, indices),
                progress=args.progress,
                **generation_options(args),
            )
        )
        if bar is not None:
            bar.update(len(indices))
    return np.concatenate(batches)


def finish(
    args: argparse.Namespace,
    folder: ShardFolder,
    shards: ShardPlan,
    labels: SampleLabels,
    summary: dict[str, Any] | None,
    generator,
) -> None:
    """Write the summary (None: keep the one there), the preview grid and the merged .npz (last, so that it implies
    the other two), then drop the shards. A damaged shard is named and sampled again (each sample is a function of
    its index)."""

    def repair(shard: Shard, error: DamagedShardError) -> np.ndarray:
        print(f"sample.py: {error}; sampling shard {shard.number} again")
        images = sample_shard(generator, shard, labels, args)
        folder.write(shard.number, lambda path: save_shard(path, shard, images, labels))
        return images

    files = SampleFiles(args.out)
    images_of = shard_reader(folder.folder, labels, repair)
    if summary is not None:
        write_json_atomic(files.summary, summary)
    if args.grid_size:
        save_grid(args, shards, images_of, labels, generator, files.grid)
    merge_shards(shards, images_of, labels[:], files.samples)
    shutil.rmtree(folder.folder)
    folder.release()


def save_grid(args: argparse.Namespace, shards: ShardPlan, images_of, labels: SampleLabels, generator, path: Path):
    """The preview PNG: about --grid-size samples in one labelled row per class (class names where the export has
    them), chosen among the first --grid-size x classes samples so that the rows fill, under a short title with the
    checkpoint's name, the guidance and the sampler; every setting of the run in the PNG's text."""
    from generation.images import class_grid_indices, save_class_grid
    from generation.run_layout import short_name

    rows = class_grid_indices(labels[: min(len(labels), args.grid_size * labels.num_classes)], args.grid_size)
    images = images_at(shards, images_of, np.concatenate([indices for _, indices in rows]))
    starts = np.cumsum([0] + [len(indices) for _, indices in rows])
    guidance = (
        f"autoguidance {args.guidance_scale:g} by {short_name(args.guide_ckpt)}"
        if args.guide_ckpt is not None
        else f"guidance {args.cfg_scale:g}"
    )
    steps = f", {args.steps} steps" if args.steps is not None else ""
    settings = run_settings(args)
    name = short_name(settings.get("export", args.ckpt))  # a run folder's newest export: "<run> step-XXXXXXX"
    title = f"{name}: {guidance}, {args.sampler or generator.objective.default_sampler}{steps}"
    grid = [(label, images[start:stop]) for (label, _), start, stop in zip(rows, starts, starts[1:])]
    save_class_grid(grid, path, title, generator.class_names, settings)


def command() -> None:
    """The installed command's entry point: a user error is one line and exit status 2."""
    run_command(main)


if __name__ == "__main__":
    command()
