"""train.py under a launcher, every process writing its post-hoc EMA averages when training ends:

    torchrun ... tests/_posthoc_ranks.py --config ... train.posthoc_ema.sigma_rel=[0.05]  # writes rank-<r>.safetensors

Only the main process writes snapshots and checkpoints; this shows what the others hold.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from safetensors.torch import save_file

    import training.loop

    real_fit = training.loop.Trainer.fit

    def fit(trainer):
        stopped = real_fit(trainer)
        tensors = {key: value.cpu().contiguous() for key, value in trainer.posthoc_ema.state_tensors().items()}
        save_file(tensors, trainer.run.root / f"rank-{trainer.accelerator.process_index}.safetensors")
        return stopped

    training.loop.Trainer.fit = fit
    import train

    train.command()


if __name__ == "__main__":
    main()
