"""Train a DiT or SiT, with Visual-Contrast Attention or the MHSA baseline, under Accelerate.

    python train.py --config configs/digits.yaml                                   # one process
    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/dit-s2-vca.yaml
    accelerate launch train.py --config configs/dit-s2-vca.yaml train.lr=2e-4 --resume latest

Overrides are `section.key=value` (see training/config.py for every key). The run lives in run.dir
(default results/<config name>): resolved config, metrics.jsonl, tracker logs (log.trackers), sample grids,
checkpoints with an export that `sample.py` loads, and milestone exports (log.export_every).

A bad argument, config value or checkpoint file stops the command with one line and exit status 2 before
anything is built or written (`--debug` shows the traceback). A run directory that already holds a run is
continued only with --resume and replaced only with --overwrite.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from atomic_files import write_text_atomic
from commands import CommandParser, run_command
from training.build import build_training
from training.checkpoint import TRAIN_CONFIG, check_checkpoint, load_checkpoint, resolve_resume
from training.config import config_to_yaml, load_config
from training.loop import Trainer, TrainerState
from training.repa import check_repa_resume
from training.run import RunDirectory, create_accelerator
from training.trackers import start_trackers


def parse_arguments(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = CommandParser(prog="train.py", description=__doc__)
    parser.add_argument("--config", required=True, help="experiment YAML: a path, or a shipped name like dit-s2-vca")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", metavar="latest|PATH",
                        help="continue from the newest checkpoint of the run (fresh start if none) or from PATH")
    resume.add_argument("--overwrite", action="store_true",
                        help="start over in a run.dir that holds an earlier run, deleting its checkpoints and logs")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return parser.parse_intermixed_args(argv)  # overrides may also follow the options


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_arguments(argv)
    config = load_config(args.config, args.overrides)             # unknown keys and bad values stop here
    run = RunDirectory(Path(config.run.dir))
    resume_from = resolve_resume(args.resume, run.checkpoints)    # so does a missing checkpoint,
    if resume_from is not None:
        check_checkpoint(resume_from)                             # a damaged one,
        check_repa_resume(resume_from / TRAIN_CONFIG, config.train.repa)  # other REPA structure,
    elif args.resume is None and not args.overwrite:
        run.check_new()                                           # and a run directory already in use
    accelerator = create_accelerator(config, run)
    parts = build_training(config, accelerator)

    state = TrainerState(num_processes=accelerator.num_processes, micro_batch_size=parts.batches.loader.batch_size,
                         grad_accum_steps=config.train.grad_accum_steps)
    saved = {}
    if resume_from is not None:
        saved = load_checkpoint(accelerator, resume_from, parts.ema)  # also restores every process's RNG
        if not state.same_geometry(saved):
            accelerator.print(f"warning: {resume_from} was written with another batch geometry ({saved}); "
                              f"the data position is approximate")
        state = state.resumed(saved)
        accelerator.print(f"resumed from {resume_from} at step {state.step}")

    accelerator.wait_for_everyone()  # every process has checked the run directory before anything is written
    if accelerator.is_main_process:
        if args.overwrite:
            run.clear()
        run.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run.config, config_to_yaml(config))
    start_trackers(accelerator, config, run.root, state.step, saved)  # a resumed run continues its tracker runs
    Trainer(accelerator, config, run, parts, state,
            last_checkpoint=None if resume_from is None else str(resume_from)).fit()


def command() -> None:
    """The installed command's entry point: a user error is one line and exit status 2."""
    run_command(main)


if __name__ == "__main__":
    command()
