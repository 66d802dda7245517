"""sample.py's arguments: the parser (its --help lists every sampler from the objectives table), the
settings of a --protocol filled in where the command line gave none, and the checks, in one line each with exit
status 2: of the arguments alone before anything is loaded (`check_args`), and against the checkpoint's
description once it is read (`check_against`).

No torch here: `sample.py --help` and a bad argument answer at once (tests/test_command_imports.py).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

from atomic_files import check_writable
from commands import CommandParser, UserError
from dit_vca.model_options import VCA_KERNEL_SETTINGS
from generation.protocols import PROTOCOLS
from generation.sample_plan import LABEL_MODES
from objectives import DEFAULT_SDE, DEFAULT_TIME_SHIFT, DIFFUSION_FORMS, LAST_STEPS, SAMPLERS


class SampleError(UserError):
    """sample.py's user error: an argument, a checkpoint or an output that cannot work as asked (the message names
    it). sweep.py's checks of its points raise it too: they are sample.py's."""


PLAIN_DEFAULTS = {"labels": "balanced", "cfg_scale": 1.0}  # without a protocol; None in the parser, so that a
# protocol can tell a value the user gave from a default


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """sample.py's parser; `description` is the command's own text (sample.py's docstring) for --help."""
    parser = CommandParser(prog="sample.py", description=description)
    add = parser.add_argument
    add("--ckpt", required=True, help="export / checkpoint / run folder, official .pt (path or released name), hub id")
    add("--model", help="architecture of an official .pt whose file name does not say it, e.g. SiT-XL/2")
    add("--image-size", type=int, help="image size of an official .pt (default: from its file name, else 256)")
    add("--vae", help="VAE hub id or local folder; overrides the checkpoint's")
    add("--num-samples", type=int, required=True)
    add("--out", type=Path, required=True, help="output .npz file")
    add(
        "--protocol",
        choices=tuple(PROTOCOLS),
        help="preset of an official evaluation: "
        + "; ".join(f"{name}: {protocol.published}" for name, protocol in PROTOCOLS.items())
        + " (explicit flags win)",
    )
    add("--labels", choices=LABEL_MODES, help="default: balanced")
    add("--seed", type=int, default=0)
    add("--per-proc-batch-size", type=int, default=32)
    add("--shard-size", type=int, default=256, help="samples per resumable shard file")
    add(
        "--grid-size",
        type=int,
        default=64,
        help="about this many samples in the preview PNG, a row per class (0: none)",
    )
    add(
        "--sampler",
        help="sampler name, with its default --steps, by the checkpoint's objective: "
        + "; ".join(f"{table.objective}: {table.describe()}" for table in SAMPLERS.values()),
    )
    add(
        "--steps",
        type=int,
        help="sampling steps, counted as intervals (default: the sampler's, listed under --sampler; adaptive "
        "solvers choose their own from --atol/--rtol)",
    )
    add("--eta", type=float, help="DDIM eta")
    add("--clip-denoised", action="store_const", const=True, help="DDPM/DDIM: clamp the predicted x_0 to [-1, 1]")
    add("--atol", type=float, help="adaptive ODE solver atol")
    add("--rtol", type=float, help="adaptive ODE solver rtol")
    add(
        "--diffusion-form",
        choices=DIFFUSION_FORMS,
        help=f"SDE samplers' diffusion coefficient w(t) (default {DEFAULT_SDE['diffusion_form']})",
    )
    add(
        "--diffusion-norm",
        type=float,
        help=f"SDE samplers' scale of w(t) (default {DEFAULT_SDE['diffusion_norm']:g})",
    )
    add(
        "--last-step",
        choices=[step for step in LAST_STEPS if step is not None],
        help=f"SDE samplers' noise-free final step (default {DEFAULT_SDE['last_step']})",
    )
    add(
        "--last-step-size",
        type=float,
        help=f"SDE samplers' final step's length (default {DEFAULT_SDE['last_step_size']:g})",
    )
    add(
        "--time-shift",
        type=float,
        help="euler/heun: shift the time grid t -> s t / (1 - (1 - s) t) (LightningDiT's timestep_shift; "
        f"0.3: more steps at the noise end, t = 0; default {DEFAULT_TIME_SHIFT:g}: none)",
    )
    add("--cfg-scale", type=float, help="classifier-free guidance scale (default 1: none)")
    add("--guide-ckpt", help="autoguidance: a weaker model of the same objective, inputs and classes (as --ckpt)")
    add("--guidance-scale", type=float, help="autoguidance scale W: guide + W * (model - guide); needs --guide-ckpt")
    add("--guidance-channels", type=int, help="guide only the first k channels (3 reproduces DiT/SiT)")
    add(
        "--guidance-interval",
        type=float,
        nargs=2,
        metavar=("LO", "HI"),
        help="guide only for times in [LO, HI] (DDPM: timestep 0..999; SiT: 0 = noise .. 1 = data)",
    )
    add(
        "--precision",
        choices=("fp32", "tf32", "bf16"),
        help="default: bf16 under `accelerate launch --mixed_precision bf16`, else tf32 on CUDA, fp32 on CPU",
    )
    add("--compile", action="store_true", help="torch.compile the model (pays off for large sample sets)")
    add(
        "--vca-kernel",
        choices=VCA_KERNEL_SETTINGS,
        default="auto",
        help="VCA's core in ATen operations or Triton kernels (default auto: Triton on CUDA, ATen elsewhere)",
    )
    add("--cpu", action="store_true", help="CPU processes (needed for torchrun on a machine without GPUs)")
    add("--progress", action="store_true", help="also show a progress bar over the sampler's steps")
    add(
        "--overwrite",
        action="store_true",
        help="replace the outputs and shards of an earlier sample.py run with "
        "other settings at --out (only files sample.py wrote are deleted)",
    )
    parser.set_defaults(guide=None)  # the guide network, once load_guide has loaded --guide-ckpt
    return parser


def parse_args(argv: Sequence[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The arguments with the protocol's settings filled in where the command line gave none, then the plain
    defaults."""
    args = build_parser(description).parse_args(argv)
    preset = PROTOCOLS[args.protocol].settings if args.protocol else {}
    if args.guide_ckpt is not None:  # autoguidance replaces the protocol's classifier-free guidance
        preset = {name: value for name, value in preset.items() if name != "cfg_scale"}
    for name, value in {**PLAIN_DEFAULTS, **preset}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def describe_protocol(args: argparse.Namespace) -> str:
    """What --protocol resolved to: each of its settings as used, those given on the command line marked."""
    parts = []
    for name, preset in PROTOCOLS[args.protocol].settings.items():
        used = getattr(args, name)
        given = "" if used == preset else f" (given; the protocol's {flag_value(preset)})"
        parts.append(f"--{name.replace('_', '-')} {flag_value(used)}{given}")
    return f"sample.py: --protocol {args.protocol}: " + " ".join(parts)


def flag_value(value) -> str:
    """A setting as it is written on the command line: "0.125 1.0" for a pair."""
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def check_args(args: argparse.Namespace) -> None:
    """Reject arguments that cannot work, before anything is loaded or written."""
    for name in ("num_samples", "per_proc_batch_size", "shard_size", "steps", "guidance_channels"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise SampleError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("grid_size", "seed"):
        if getattr(args, name) < 0:
            raise SampleError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not math.isfinite(args.cfg_scale) or args.cfg_scale < 0:
        raise SampleError(f"--cfg-scale must be a finite number >= 0, got {args.cfg_scale}")
    check_autoguidance_args(args)
    if args.time_shift is not None and not (math.isfinite(args.time_shift) and args.time_shift > 0):
        raise SampleError(f"--time-shift must be a finite number > 0 (1: no shift), got {args.time_shift}")
    if args.guidance_interval is not None and not args.guidance_interval[0] < args.guidance_interval[1]:
        low, high = args.guidance_interval
        raise SampleError(f"--guidance-interval {low} {high}: expected LO < HI")
    if args.out.suffix != ".npz":
        raise SampleError(f"--out {args.out}: expected a file name ending in .npz")
    check_writable(args.out.parent)  # or, where it does not exist yet, its nearest existing parent


def check_autoguidance_args(args: argparse.Namespace) -> None:
    """--guide-ckpt and --guidance-scale come together, and instead of --cfg-scale."""
    if (args.guide_ckpt is None) != (args.guidance_scale is None):
        given, missing = (
            ("--guide-ckpt", "--guidance-scale")
            if args.guidance_scale is None
            else ("--guidance-scale", "--guide-ckpt")
        )
        raise SampleError(f"{given} needs {missing} (autoguidance: guide + W * (model - guide))")
    if args.guide_ckpt is None:
        return
    if not math.isfinite(args.guidance_scale) or args.guidance_scale < 0:
        raise SampleError(f"--guidance-scale must be a finite number >= 0, got {args.guidance_scale}")
    if args.cfg_scale != 1:
        raise SampleError(f"--cfg-scale {args.cfg_scale} with --guide-ckpt: use one guidance, not both")


def check_against(description, args: argparse.Namespace) -> None:
    """Reject sampler and guidance settings that the checkpoint cannot serve (before any file is written)."""
    from dit_vca.model_spec import model_family  # the model names' table: where a protocol's family is told

    family = model_family(description.model.name)
    if args.protocol and (made_for := PROTOCOLS[args.protocol].family) != family:
        suited = [name for name, protocol in PROTOCOLS.items() if protocol.family == family]
        raise SampleError(
            f"--protocol {args.protocol}: made for {made_for} models, but {args.ckpt} is a {family} "
            f"model; use {' or '.join(suited)}"
        )
    names = SAMPLERS[description.objective.kind].names
    if args.sampler is not None and args.sampler not in names:
        raise SampleError(f"--sampler {args.sampler!r}: this checkpoint's objective offers {', '.join(names)}")
    if args.cfg_scale != 1 and not description.has_null_class:
        raise SampleError(
            f"--cfg-scale {args.cfg_scale}: the model was trained without label dropout, so it has no "
            f"null class for classifier-free guidance"
        )
    if args.guidance_channels is not None and args.guidance_channels > description.channels:
        raise SampleError(
            f"--guidance-channels {args.guidance_channels}: the model predicts only {description.channels} channels"
        )
    if args.vae is not None and description.in_pixel_space:
        raise SampleError(f"--vae {args.vae}: the model of {args.ckpt} works in pixel space and uses no VAE")
