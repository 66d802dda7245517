"""Experiment trackers (log.trackers): TensorBoard for real, wandb through a stand-in module (wandb is an optional
extra and not installed here), sample grids as images, and a resumed run continuing the same wandb run."""

import importlib.machinery
import importlib.util
import io
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from accelerate.state import AcceleratorState, GradientState
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from training.config import ConfigError, LogConfig
from training.trackers import check_trackers

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"
TINY = [
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "train.global_batch_size=32",
    "train.warmup_steps=2",
    "log.sample_count=4",
    "log.sample_steps=3",
    "log.every=2",
    "log.checkpoint_every=2",
    "log.sample_every=2",
]


class FakeWandb(types.ModuleType):
    """The part of wandb that Accelerate's WandBTracker calls, recording every call."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # found by importlib.util.find_spec
        self.inits, self.logged, self.configs, self.finished = [], [], [], 0
        self.config = types.SimpleNamespace(update=lambda values, allow_val_change: self.configs.append(values))
        self.Image = FakeImage

    def init(self, **kwargs):
        self.inits.append(kwargs)
        wandb = self

        class Run:
            def log(self, values, step=None):
                wandb.logged.append((step, values))

            def finish(self):
                wandb.finished += 1

        return Run()


class FakeImage:
    def __init__(self, data) -> None:
        self.data = np.asarray(data)


@pytest.fixture
def wandb(monkeypatch) -> FakeWandb:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


@pytest.fixture
def train_main():
    """train.py's main; Accelerate's process-wide state is reset after each test."""
    import train

    yield train.main
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def png(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def test_unknown_or_missing_trackers_are_named(monkeypatch):
    with pytest.raises(ConfigError, match="'log.trackers' has 'wandbb'; valid choices: .*tensorboard.*wandb"):
        check_trackers(LogConfig(trackers=["tensorboard", "wandbb"]))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    if importlib.util.find_spec("wandb") is None:  # the optional extra is not part of the test environment
        with pytest.raises(ConfigError, match=r"the wandb package is not installed .*vca-diffusion\[wandb\]"):
            check_trackers(LogConfig(trackers=["wandb"]))
    with pytest.raises(ConfigError, match="names a tracker twice"):
        check_trackers(LogConfig(trackers=["tensorboard", "tensorboard"]))
    check_trackers(LogConfig(trackers=[]))
    check_trackers(LogConfig(trackers=["tensorboard"]))


@pytest.mark.slow
def test_wandb_and_tensorboard_get_metrics_and_grids_and_a_resumed_run_continues(wandb, train_main, tmp_path):
    run_dir = tmp_path / "run"
    trackers = [
        "log.trackers=[tensorboard,wandb]",
        "log.project=vca-test",
        "log.run_name=tiny-digits",
        f"run.dir={run_dir}",
    ]
    train_main(["--config", str(DIGITS), *TINY, *trackers, "train.max_steps=4"])

    [init] = wandb.inits
    run_id = init.pop("id")
    assert init == {"project": "vca-test", "name": "tiny-digits", "resume": "allow", "dir": str(run_dir)}
    assert len(run_id) == 8
    [hyperparameters] = wandb.configs
    assert hyperparameters["train.max_steps"] == 4 and hyperparameters["log.project"] == "vca-test"
    assert wandb.finished == 1
    # Scalars and the grid of each sampling step, the grid exactly as saved to samples/.
    assert [step for step, values in wandb.logged if "train/loss" in values] == [2, 4]
    grids = [(step, values["samples/ema"]) for step, values in wandb.logged if "samples/ema" in values]
    assert [step for step, _ in grids] == [2, 4]
    for step, [image] in grids:
        np.testing.assert_array_equal(image.data, png(run_dir / "samples" / f"step-{step:07d}.png"))
    # The id is stored in every checkpoint for the resume.
    state = json.loads((run_dir / "checkpoints" / "step-0000004" / "trainer_state.json").read_text())
    assert state["trackers"] == {"wandb": run_id}

    # TensorBoard, read back from its event files: the same grids, decoded from the stored PNG.
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0}).Reload()
    images = events.Images("samples/ema")
    assert [event.step for event in images] == [2, 4]
    for event in images:
        decoded = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
        np.testing.assert_array_equal(decoded, png(run_dir / "samples" / f"step-{event.step:07d}.png"))

    # Resume: the same wandb run (id, resume="allow"), logging from step 5 on.
    before = len(wandb.logged)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train_main(["--config", str(DIGITS), *TINY, *trackers, "train.max_steps=6", "--resume", "latest"])
    assert len(wandb.inits) == 2 and wandb.inits[1]["id"] == run_id and wandb.inits[1]["resume"] == "allow"
    assert [step for step, values in wandb.logged[before:] if "samples/ema" in values] == [6]


@pytest.mark.slow
def test_a_new_run_gets_a_new_tracker_run(wandb, train_main, tmp_path):
    for name in ("first", "second"):
        train_main(
            [
                "--config",
                str(DIGITS),
                *TINY,
                "log.trackers=[wandb]",
                f"run.dir={tmp_path / name}",
                "train.max_steps=2",
                "log.sample_every=0",
            ]
        )
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    first, second = wandb.inits
    assert first["id"] != second["id"] and (first["name"], second["name"]) == ("first", "second")
    assert first["project"] == "vca-diffusion"  # LogConfig's default
    assert not (tmp_path / "first" / "tensorboard").exists()


def test_tensorboard_shows_one_run_per_training_run_with_its_hyperparameters(train_main, tmp_path):
    """Everything in <run>/tensorboard/ itself: no timestamp folders beside it (Accelerate's add_hparams made two,
    each a run of its own in TensorBoard), the hyper-parameters in the same event file as the metrics."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir = tmp_path / "run"
    arguments = [*TINY, "log.sample_every=0", "log.trackers=[tensorboard]", f"run.dir={run_dir}"]
    train_main(["--config", str(DIGITS), *arguments, "train.max_steps=2"])
    folder = run_dir / "tensorboard"
    assert [path.is_file() for path in folder.iterdir()] == [True]  # one event file, no folders
    events = EventAccumulator(str(folder)).Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [2]
    session = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    )
    assert session.session_start_info.hparams["train.max_steps"].number_value == 2
    assert session.session_start_info.hparams["model.name"].string_value == "DiT-S/2"
