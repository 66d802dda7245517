"""Experiment trackers of a training run (`log.trackers`), through Accelerate's tracker classes.

TensorBoard writes to <run>/tensorboard/; a resumed run purges the events that a killed run wrote after the
checkpoint's step. The other trackers (wandb, comet_ml, mlflow, ...) get `log.project`; wandb also gets
`log.run_name` (default: the run directory's name), files under the run directory, and a run id chosen here.
That id is stored in every checkpoint's trainer_state.json (under "trackers") and handed back on resume with
resume="allow", so a resumed training run continues the same wandb run instead of starting a new one.
Sample grids go to every tracker that takes images.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from accelerate import Accelerator
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker
from accelerate.utils import LoggerType

from generation.run_layout import TENSORBOARD_FOLDER
from training.config import Config, ConfigError, LogConfig, config_to_dict

TRACKER_NAMES = tuple(kind.value for kind in LoggerType if kind is not LoggerType.ALL)  # each also its module name
STATE_KEY = "trackers"  # trainer_state.json: {"trackers": {"wandb": "<run id>"}}
RESUMABLE = ("wandb",)  # trackers whose run continues on resume (by the id above)
GRID_KEY = "samples/ema"
IMAGE_OPTIONS = {"tensorboard": {"dataformats": "NHWC"}}  # the grid is (1, H, W, 3) uint8


def check_trackers(log: LogConfig) -> None:
    """Every name in `log.trackers` is a tracker Accelerate knows and its package is installed (Accelerate itself
    would drop a missing one silently)."""
    if len(set(log.trackers)) < len(log.trackers):
        raise ConfigError(f"'log.trackers' names a tracker twice: {log.trackers}")
    for name in log.trackers:
        if name not in TRACKER_NAMES:
            raise ConfigError(f"'log.trackers' has {name!r}; valid choices: {', '.join(TRACKER_NAMES)}")
        if importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"'log.trackers' has {name!r}, but the {name} package is not installed "
                f"(pip install {name}; for wandb also: pip install 'vca-diffusion[wandb]')"
            )


def run_name(log: LogConfig, run_dir: Path) -> str:
    return log.run_name or run_dir.name


def create_trackers(log: LogConfig, run_dir: Path, start_step: int, resumed: dict[str, str]) -> list[GeneralTracker]:
    """Tracker objects for `log.trackers` (nothing starts until Accelerator.init_trackers); `resumed` maps a
    tracker name to the run id a checkpoint stored."""
    trackers = []
    for name in log.trackers:
        tracker_class = LOGGER_TYPE_TO_CLASS[name]
        if name == "tensorboard":
            trackers.append(tracker_class(TENSORBOARD_FOLDER, run_dir, purge_step=start_step + 1))
        elif name == "wandb":
            trackers.append(
                tracker_class(
                    log.project,
                    name=run_name(log, run_dir),
                    id=resumed.get(name) or new_run_id(),
                    resume="allow",
                    dir=str(run_dir),
                )
            )
        elif tracker_class.requires_logging_directory:
            trackers.append(tracker_class(log.project, run_dir))
        else:
            trackers.append(tracker_class(log.project))
    return trackers


def new_run_id() -> str:
    """A fresh id for a hosted tracker's run: 8 lowercase hex digits, like wandb's own."""
    return uuid.uuid4().hex[:8]


def start_trackers(
    accelerator: Accelerator, config: Config, run_dir: Path, start_step: int, saved_state: dict[str, Any]
) -> None:
    """Start the trackers of `config` (main process) in the run directory `run_dir`, continuing the tracker runs
    that `saved_state` (the resumed checkpoint's trainer state; {} for a fresh run) names, and record the config as
    hyper-parameters."""
    accelerator.log_with = create_trackers(config.log, run_dir, start_step, saved_state.get(STATE_KEY, {}))
    accelerator.init_trackers(config.log.project)  # the hyper-parameters are recorded below
    values = hyperparameters(config_to_dict(config))
    for tracker in accelerator.trackers:  # the main process's
        if tracker.name == "tensorboard":
            record_tensorboard_hyperparameters(tracker.writer, values)
        else:
            tracker.store_init_configuration(values)


def record_tensorboard_hyperparameters(writer: Any, values: dict[str, Any]) -> None:
    """The hyper-parameters in the run's own event file (TensorBoard's HPARAMS tab), so TensorBoard shows one run
    per training run. Accelerate's tracker goes through SummaryWriter.add_hparams, which writes them into a new
    folder named by the time (a second run in TensorBoard), and then makes a third such folder for a YAML copy
    (the run's config.yaml is that record)."""
    from torch.utils.tensorboard.summary import hparams

    for summary in hparams(values, metric_dict={}):  # experiment, session start and end
        writer.file_writer.add_summary(summary)
    writer.flush()


def tracker_state(accelerator: Accelerator) -> dict[str, Any]:
    """What a checkpoint stores so that a resumed run continues the same tracker runs ({} when none can)."""
    runs = {tracker.name: tracker.init_kwargs["id"] for tracker in accelerator.trackers if tracker.name in RESUMABLE}
    return {STATE_KEY: runs} if runs else {}


def log_grid(accelerator: Accelerator, path: Path, step: int) -> None:
    """Send the sample grid saved at `path` to every tracker that takes images (call on the main process)."""
    from PIL import Image

    with Image.open(path) as image:
        grid = np.asarray(image.convert("RGB"))[None]  # (1, H, W, 3) uint8
    for tracker in accelerator.trackers:
        if hasattr(tracker, "log_images"):  # GeneralTracker has none; TensorBoard, wandb, aim, ... do
            tracker.log_images({GRID_KEY: grid}, step=step, **IMAGE_OPTIONS.get(tracker.name, {}))


def hyperparameters(tree: dict, prefix: str = "") -> dict:
    """Flatten the config into the scalar hyper-parameters every tracker accepts ("train.lr": 1e-4, ...)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(hyperparameters(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat
