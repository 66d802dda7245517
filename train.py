"""Train a DiT or SiT, with Visual-Contrast Attention or the MHSA baseline, under Accelerate.

    python train.py --config configs/digits.yaml                                   # one process
    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/dit-s2-vca.yaml
    accelerate launch train.py --config configs/dit-s2-vca.yaml train.lr=2e-4 --resume latest
    python train.py --resume results/digits train.max_steps=4000                   # the run's own config.yaml

Overrides are `section.key=value`; every key is listed below with its default (training/config.py). The run
lives in run.dir (default results/<config name>): resolved config, metrics.jsonl, tracker logs (log.trackers),
sample grids, checkpoints with an export that `sample.py` loads, and milestone exports (log.export_every). Before
the first step the launch prints what it will do (training.summary: model, data, batch geometry, precision,
devices, resume point) and keeps it as startup.txt.

SIGTERM, SIGUSR1 or SIGINT (Slurm's preemption and time-limit signals, Ctrl-C) stop the run after the current
optimiser step on every process, with a checkpoint; the command then exits with status 75 (STOPPED_STATUS),
which a requeue script tests before relaunching with --resume latest. Repeated SIGTERM/SIGUSR1 are one stop; a
second SIGINT 2 s or more after the first ends it at once (training.stop_signals).

A bad argument, config value or checkpoint file stops the command with one line and exit status 2 before
anything is built or written (`--debug` shows the traceback). A run directory that already holds a run is
continued only with --resume and replaced only with --overwrite; while a launch runs, a second train.py into its
run.dir is refused. With --resume, the model, objective, data and seed stay the checkpoint's (another value is
refused, naming it); every other setting, such as train.lr above, applies from the resume step on, and
config.yaml records this launch's values. A resume without --config uses the run's own config.yaml
(training.run.load_launch_config).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from commands import CommandParser, run_command


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    from training.config_help import describe_keys  # the config schema, without torch: --help answers at once

    parser = CommandParser(prog="train.py", description=__doc__, epilog=describe_keys())
    parser.add_argument(
        "--config",
        help="experiment YAML: a path, or a shipped name like dit-s2-vca (a resume without it uses the run's own)",
    )
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        metavar="latest|RUN|CHECKPOINT",
        help="continue from the newest checkpoint of run.dir (fresh start if none), of the run folder RUN, "
        "or from the checkpoint folder CHECKPOINT",
    )
    resume.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run.dir that holds an earlier run, deleting its checkpoints and logs",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return parser.parse_intermixed_args(argv)  # overrides may also follow the options


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_arguments(argv)
    # Libraries are imported once the checks before them have passed: --help and a bad argument answer before
    # torch is imported; the launch's config (--config's file, or a resume's own config.yaml), its unknown keys
    # and bad values, and a missing checkpoint to resume from before accelerate, diffusers and timm (seconds each).
    from generation.run_layout import TRAIN_CONFIG
    from training.checkpoint_folders import resolve_resume
    from training.config import config_to_yaml
    from training.run import RunDirectory, load_launch_config

    config, resume = load_launch_config(args.config, args.resume, args.overrides)  # a bad config stops here,
    run = RunDirectory(Path(config.run.dir))
    resume_from = resolve_resume(resume, run.checkpoints)  # a missing checkpoint,

    from atomic_files import check_writable, write_text_atomic
    from training.accelerator import create_accelerator
    from training.build import build_training
    from training.checkpoint import apply_optimizer_settings, check_checkpoint, check_resume_settings, load_checkpoint
    from training.loop import Trainer, TrainerState, say
    from training.power_ema import check_resume as check_posthoc_resume
    from training.repa import check_repa_resume
    from training.stop_signals import STOPPED_STATUS, record_stopped_status, stop_with_the_launcher
    from training.summary import startup_summary
    from training.trackers import start_trackers

    if resume_from is not None:
        check_checkpoint(resume_from)  # a damaged one,
        check_resume_settings(config, resume_from)  # another model, objective, data or seed,
        check_repa_resume(resume_from / TRAIN_CONFIG, config.train.repa)  # another REPA structure,
        check_posthoc_resume(resume_from, config.train.posthoc_ema)  # other post-hoc EMA profiles,
    elif args.resume is None and not args.overwrite:
        run.check_new()  # and a run directory already in use,
    check_writable(run.root)  # or one where nothing can be written
    stop_with_the_launcher()  # under torchrun: its death is a stop signal (a worker never trains on as an orphan)
    accelerator = create_accelerator(config, run)
    with run.claimed(accelerator):  # a second train.py into this run.dir stops here, before anything is built
        parts = build_training(config, accelerator)

    state = TrainerState(
        num_processes=accelerator.num_processes,
        micro_batch_size=parts.batches.loader.batch_size,
        grad_accum_steps=config.train.grad_accum_steps,
    )
    saved = {}
    if resume_from is not None:
        saved = load_checkpoint(accelerator, resume_from, parts.ema)  # also restores every process's RNG
        apply_optimizer_settings(parts.optimizer, parts.scheduler, config.train)  # this launch's lr, betas, ...
        if parts.posthoc_ema is not None:
            parts.posthoc_ema.load_state(resume_from)
        state = state.resumed(saved)

    summary = startup_summary(config, accelerator, parts, state, run.root, resume_from, saved)
    say(accelerator, summary, end="")  # once per job, not once per node
    accelerator.wait_for_everyone()  # every process has checked the run directory before anything is written
    if accelerator.is_main_process:
        if args.overwrite:
            kept = run.clear()
            if kept:
                names = ", ".join(str(path.relative_to(run.root)) for path in kept)
                accelerator.print(f"--overwrite: kept {names} (not written by a training run)")
        run.root.mkdir(parents=True, exist_ok=True)
        run.remove_partial_saves()
        write_text_atomic(run.config, config_to_yaml(config))
        write_text_atomic(run.startup, summary)
    start_trackers(accelerator, config, run.root, state.step, saved)  # a resumed run continues its tracker runs
    try:
        stopped_by = Trainer(
            accelerator, config, run, parts, state, last_checkpoint=None if resume_from is None else str(resume_from)
        ).fit()
    finally:
        run.unlock()  # the launch's, not the process's: a test or notebook may launch again
    if stopped_by is not None:
        record_stopped_status()  # for a wrapper of a launcher that does not pass 75 on (docs/slurm/torchrun.sh)
        raise SystemExit(STOPPED_STATUS)


def command() -> None:
    """The installed command's entry point: a user error is one line and exit status 2."""
    run_command(main)


if __name__ == "__main__":
    command()
