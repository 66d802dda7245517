"""Train a DiT or SiT, with Visual-Contrast Attention or the MHSA baseline, under Accelerate.

    python train.py --config configs/digits.yaml                                   # one process
    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/dit-s2-vca.yaml
    accelerate launch train.py --config configs/dit-s2-vca.yaml train.lr=2e-4 --resume latest

Overrides are `section.key=value` (see training/config.py for every key). The run lives in run.dir
(default results/<config name>): resolved config, metrics.jsonl, tracker logs (log.trackers), sample grids and
checkpoints with an export that `sample.py` loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from atomic_files import write_text_atomic
from training.build import build_training
from training.checkpoint import load_checkpoint, resolve_resume
from training.config import config_to_yaml, load_config
from training.loop import Trainer, TrainerState
from training.run import RunDirectory, create_accelerator
from training.trackers import start_trackers


def parse_arguments(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="experiment YAML: a path, or a shipped name like dit-s2-vca")
    parser.add_argument("--resume", metavar="latest|PATH",
                        help="continue from the newest checkpoint of the run (fresh start if none) or from PATH")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_arguments(argv)
    config = load_config(args.config, args.overrides)             # unknown keys and bad values stop here
    run = RunDirectory(Path(config.run.dir))
    resume_from = resolve_resume(args.resume, run.checkpoints)    # so does a missing checkpoint
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

    if accelerator.is_main_process:
        run.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run.config, config_to_yaml(config))
    start_trackers(accelerator, config, run, state.step, saved)  # a resumed run continues its tracker runs
    Trainer(accelerator, config, run, parts, state,
            last_checkpoint=None if resume_from is None else str(resume_from)).fit()


if __name__ == "__main__":
    main()
