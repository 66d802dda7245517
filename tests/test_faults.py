"""Faults users meet on clusters (issue 21): stop signals, full and read-only disks, resumes with changed
settings, outputs that are inputs, folders in use, writes that must survive a crash of the machine.
The faults come from tests/_faults.py.

The principle every case checks: a command checks what it can before it writes anything, and what it leaves
after a failure is a whole earlier state or nothing.
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from _faults import failing_writes, signal_at_step
from _launch import TORCHRUN_TWO_PROCESSES, launch, subprocess_env
from _tiny_data import extraction_config, latent_shards, make_images
from _tiny_runs import TINY, TWO_PROCESSES_8_STEPS, assert_same_checkpoint, latent_run, logged, run_train
from atomic_files import OutputError
from commands import UserError
from sample_arguments import SampleError
from training.stop_signals import STOPPED_STATUS

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"
ONE_PROCESS = [
    "--config",
    str(DIGITS),
    *TINY,
    "log.every=2",
    "log.checkpoint_every=4",
    "log.sample_every=0",
    "train.max_steps=8",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A one-process run of 8 steps: the reference a stopped and resumed run must equal."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_train(*ONE_PROCESS, f"run.dir={run_dir}")
    return run_dir


# --------------------------------------------------------------------------------------------------
#                                          Stop signals
# --------------------------------------------------------------------------------------------------


# SIGTERM after step 2 stops on a logging step (log.every=2); the others in the middle of a logging window.
@pytest.mark.parametrize("name, step", [("SIGTERM", 2), ("SIGUSR1", 3), ("SIGINT", 3)])
def test_a_stop_signal_checkpoints_the_step_and_the_resumed_run_equals_an_uninterrupted_one(
    uninterrupted, tmp_path, monkeypatch, name, step
):
    run_dir = tmp_path / "run"
    handler_before = signal.getsignal(getattr(signal, name))
    signal_at_step(monkeypatch, step=step, signals=[name])
    with pytest.raises(SystemExit) as exited:
        run_train(*ONE_PROCESS, f"run.dir={run_dir}")
    assert exited.value.code == STOPPED_STATUS == 75
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step-{step:07d}"]  # the step in progress
    assert signal.getsignal(getattr(signal, name)) is handler_before  # the handlers are put back

    monkeypatch.undo()
    run_train(*ONE_PROCESS, f"run.dir={run_dir}", "--resume", "latest")
    assert_same_checkpoint(run_dir / "checkpoints" / "step-0000008", uninterrupted / "checkpoints" / "step-0000008")
    # the same log lines: the stop's own line written, the window's sums carried over in the checkpoint
    assert logged(run_dir) == logged(uninterrupted)


def fault_run(run_dir: Path, fault: str, at_exit: str = "") -> subprocess.CompletedProcess:
    """train.py (ONE_PROCESS) as its own process, signalled as FAULT_SIGNAL and FAULT_AT_EXIT say
    (tests/_faults.py)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_faults.py"), *ONE_PROCESS, f"run.dir={run_dir}"],
        cwd=ROOT,
        env={**subprocess_env(), "FAULT_SIGNAL": fault, "FAULT_AT_EXIT": at_exit},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_stop_signal_repeated_as_a_scheduler_and_a_launcher_send_it_is_one_stop(tmp_path):
    # Slurm signals every process of a step, srun and torchrun forward: one worker sees SIGTERM two or three times
    # within milliseconds, and SIGUSR1 besides when the batch script forwards its --signal=B:USR1. More of them
    # come while the process shuts down after the checkpoint (issue 38: 1-4 s after the "stopped" line the old
    # code died of them, status 143 or 138): the status stays 75, however many and whichever.
    run_dir = tmp_path / "run"
    repeated = "SIGTERM+SIGTERM+SIGUSR1+SIGTERM+SIGINT"
    done = fault_run(run_dir, f"5:*:{repeated}:self", at_exit=repeated)
    assert done.returncode == STOPPED_STATUS, done.stderr[-2000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000004", "step-0000005"]
    assert "stopped by SIGTERM after step 5: checkpoint" in done.stdout


def test_a_second_ctrl_c_ends_the_process_at_once_and_says_which_checkpoint_stands(tmp_path):
    # A user's second Ctrl-C, later than REPEAT_WINDOW_S (2 s) after the first, ends the process before the
    # checkpoint of the step; the message names the one that stands.
    run_dir = tmp_path / "run"
    done = fault_run(run_dir, "5:*:SIGINT+2.5+SIGINT:self")
    assert done.returncode == -signal.SIGINT, done.stderr[-2000:]
    standing = run_dir / "checkpoints" / "step-0000004"
    assert (
        f"SIGINT again: ending at once, without a checkpoint of this step; the last checkpoint, {standing}, is "
        "intact" in done.stderr
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000004"]


def test_a_second_ctrl_c_during_a_checkpoint_names_the_abandoned_one(tmp_path):
    from training.loop import Trainer

    trainer = Trainer.__new__(Trainer)  # only what standing() reads
    trainer.last_checkpoint, trainer.saving_step = str(tmp_path / "step-0000004"), 6
    assert trainer.standing() == (
        f"the checkpoint of step 6, being written, is abandoned and the last checkpoint, {tmp_path / 'step-0000004'}, "
        "is intact"
    )


def torchrun_8_steps(run_dir: Path, *extra: str, script: Path = ROOT / "train.py", launcher: tuple = ()) -> list[str]:
    return [
        *TORCHRUN_TWO_PROCESSES,
        *launcher,
        str(script),
        *TWO_PROCESSES_8_STEPS,
        f"run.dir={run_dir}",
        *extra,
    ]


def test_a_signal_to_one_of_two_processes_stops_both_after_the_same_step_and_resumes_exactly(tmp_path):
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    done = launch(torchrun_8_steps(reference))
    assert done.returncode == 0, done.stderr[-3000:]

    stopped = launch(torchrun_8_steps(run_dir, script=ROOT / "tests" / "_faults.py"), fault="3:1:SIGUSR1:self")
    # The first worker to finish exits 75; torchrun then ends the other one (its checkpoint part is written:
    # save_checkpoint returns after a barrier) and reports the failure with its own status 1.
    assert stopped.returncode == 1 and f"exitcode  : {STOPPED_STATUS}" in stopped.stderr, stopped.stderr[-3000:]
    assert "stopped by a signal to another process after step 3" in stopped.stdout  # rank 0 was told by rank 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000003"]
    assert json.loads((run_dir / "checkpoints" / "step-0000003" / "trainer_state.json").read_text())["step"] == 3

    resumed = launch(torchrun_8_steps(run_dir, "--resume", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_checkpoint(run_dir / "checkpoints" / "step-0000008", reference / "checkpoints" / "step-0000008")


def test_a_signal_to_the_launcher_stops_every_process_with_a_checkpoint(tmp_path):
    # torchrun (like accelerate launch) forwards SIGTERM to its workers, as the batch script of docs/training.md
    # relies on.
    # Rank 0 signals torchrun after step 3; both workers stop after the same step.
    run_dir = tmp_path / "run"
    stopped = launch(torchrun_8_steps(run_dir, script=ROOT / "tests" / "_faults.py"), fault="3:0:SIGTERM:parent")
    assert stopped.returncode != 0 and "stopped by SIGTERM after step" in stopped.stdout, stopped.stderr[-3000:]
    found = list((run_dir / "checkpoints").iterdir())
    assert len(found) == 1, (found, stopped.stdout, stopped.stderr[-3000:])
    [checkpoint] = found
    step = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    assert 3 <= step < 8 and checkpoint.name == f"step-{step:07d}"
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= {p.name for p in checkpoint.iterdir()}


# --------------------------------------------------------------------------------------------------
#                                 Full and read-only disks (tests/_faults.py)
# --------------------------------------------------------------------------------------------------


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def test_a_full_disk_during_a_checkpoint_leaves_the_earlier_one_to_resume(uninterrupted, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    # Room for config.yaml and the checkpoint of step 4, and half of the one of step 8.
    room = len((uninterrupted / "config.yaml").read_bytes()) + folder_bytes(
        uninterrupted / "checkpoints" / "step-0000004"
    )
    budget = failing_writes(
        monkeypatch, errno.ENOSPC, after_bytes=room + folder_bytes(uninterrupted / "checkpoints" / "step-0000008") // 2
    )
    with pytest.raises(OutputError) as raised:
        run_train(*ONE_PROCESS, f"run.dir={run_dir}")
    message = str(raised.value)
    assert f"cannot write {run_dir / 'checkpoints' / 'step-0000008'}: no space left on its disk (" in message
    assert "bytes needed" in message and "step-0000004, is intact" in message and "\n" not in message
    assert budget.failures and [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-0000004"]  # no .tmp

    monkeypatch.undo()
    run_train(*ONE_PROCESS, f"run.dir={run_dir}", "--resume", "latest")
    assert_same_checkpoint(run_dir / "checkpoints" / "step-0000008", uninterrupted / "checkpoints" / "step-0000008")


def test_training_into_a_read_only_folder_fails_before_the_model_is_built(tmp_path, monkeypatch):
    import training.build

    monkeypatch.setattr(training.build, "build_training", lambda *a: pytest.fail("the model was built"))
    failing_writes(monkeypatch, errno.EROFS)
    with pytest.raises(OutputError, match=r"cannot write .*: read-only file system; choose a writable place"):
        run_train(*ONE_PROCESS, f"run.dir={tmp_path / 'run'}")
    assert list(tmp_path.iterdir()) == []


def test_the_read_only_error_names_the_folder_not_the_probe(tmp_path, monkeypatch):
    import errno

    from atomic_files import OutputError, check_writable

    failing_writes(monkeypatch, errno.EROFS)
    try:
        check_writable(tmp_path)
    except OutputError as error:
        assert str(error) == f"cannot write {tmp_path}: read-only file system; choose a writable place"
    else:
        raise AssertionError("the read-only folder was not found")
    assert list(tmp_path.iterdir()) == []


def statistics(path: Path, shift: float) -> Path:
    import numpy as np

    from fid.inception_spec import FEATURE_DIMS

    spatial = FEATURE_DIMS["spatial"]
    np.savez(path, mu=np.full(2048, shift), sigma=np.eye(2048), mu_s=np.zeros(spatial), sigma_s=np.eye(spatial))
    return path


@pytest.fixture
def fid_inputs(tmp_path):
    return statistics(tmp_path / "samples.npz", 0.0), statistics(tmp_path / "ref.npz", 0.1)


@pytest.mark.parametrize(
    "flag, target",
    [("--json", "samples.npz"), ("--json", "ref.npz"), ("--save-stats", "ref.npz"), ("--save-stats", "samples.npz")],
)
def test_fid_refuses_an_output_that_is_an_input(fid_inputs, flag, target):
    import fid.__main__ as fid_command
    from fid.errors import InputError

    samples, ref = fid_inputs
    before = {path: path.read_bytes() for path in (samples, ref)}
    with pytest.raises(InputError, match=f"{flag} .*{target} is (SAMPLES|REF) itself; choose another file"):
        fid_command.main([str(samples), str(ref), "--metrics", "fid", flag, str(samples.parent / target)])
    assert {path: path.read_bytes() for path in (samples, ref)} == before


def test_fid_replaces_only_files_it_wrote(fid_inputs, tmp_path):
    import numpy as np

    import fid.__main__ as fid_command
    from atomic_files.ownership import ForeignFileError

    samples, ref = fid_inputs
    images, notes = tmp_path / "images.npz", tmp_path / "notes.json"
    np.savez(images, arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    notes.write_text('{"mine": 1}\n')
    for flag, path in (("--save-stats", images), ("--json", notes)):
        before = path.read_bytes()
        with pytest.raises(ForeignFileError, match=f"{flag} {path} exists and was not written by python -m fid"):
            fid_command.main([str(samples), str(ref), "--metrics", "fid", flag, str(path)])
        assert path.read_bytes() == before
    report, stats = tmp_path / "report.json", tmp_path / "stats.npz"
    for _ in range(2):  # the second run replaces what the first one wrote (no REF: no metric, only the copy)
        fid_command.main([str(samples), "--json", str(report), "--save-stats", str(stats)])
    assert json.loads(report.read_text())["samples"] == str(samples)
    with np.load(stats) as copied:
        assert sorted(copied.files) == ["mu", "mu_s", "sigma", "sigma_s"]


@pytest.mark.parametrize(
    "error, message", [(errno.EROFS, "read-only file system"), (errno.ENOSPC, "no space left on its disk")]
)
def test_fid_outputs_on_a_failing_disk_keep_the_older_file(fid_inputs, tmp_path, monkeypatch, error, message):
    import fid.__main__ as fid_command
    import fid.evaluation

    samples, ref = fid_inputs
    report = tmp_path / "report.json"
    fid_command.main([str(samples), "--save-stats", str(tmp_path / "stats.npz"), "--json", str(report)])
    (tmp_path / "stats.npz").unlink()
    before = report.read_bytes()
    # a read-only folder is found before any feature is computed; a full disk when the report is written
    evaluate = fid.evaluation.evaluate  # main imports it from fid.evaluation once its arguments are checked
    monkeypatch.setattr(
        fid.evaluation,
        "evaluate",
        lambda *a, **k: pytest.fail("evaluated") if error == errno.EROFS else evaluate(*a, **k),
    )
    failing_writes(monkeypatch, error, after_bytes=10)
    with pytest.raises(OutputError, match=f"cannot write .*: {message}"):
        fid_command.main([str(samples), "--save-stats", str(tmp_path / "stats.npz"), "--json", str(report)])
    assert report.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "ref.npz",
        "report.json",
        "samples.npz",
    ]


# --------------------------------------------------------------------------------------------------
#                                 --resume with changed settings
# --------------------------------------------------------------------------------------------------


def copy_run(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    shutil.rmtree(target / "checkpoints" / "step-0000008")  # resume from step 4
    return target


def test_optimiser_settings_given_with_resume_apply_from_the_resume_step(uninterrupted, tmp_path):
    run_dir = copy_run(uninterrupted, tmp_path / "run")
    run_train(
        *ONE_PROCESS,
        f"run.dir={run_dir}",
        "train.lr=5e-4",
        "train.weight_decay=0.25",
        "train.betas=[0.8,0.99]",
        "--resume",
        "latest",
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    original = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert [line["lr"] for line in lines[:2]] == [line["lr"] for line in original[:2]]  # steps 2, 4: before
    assert [line["lr"] for line in lines[2:]] == [5e-4, 5e-4]  # steps 6, 8 (warm-up of 5 steps done)
    groups = torch.load(run_dir / "checkpoints" / "step-0000008" / "optimizer.bin", weights_only=True)["param_groups"]
    assert all(
        (group["lr"], group["weight_decay"], tuple(group["betas"])) == (5e-4, 0.25, (0.8, 0.99)) for group in groups
    )
    config = (run_dir / "config.yaml").read_text()
    assert "lr: 0.0005" in config and "weight_decay: 0.25" in config  # config.yaml tells what was applied
    ours = load_file(run_dir / "checkpoints" / "step-0000008" / "model.safetensors")
    theirs = load_file(uninterrupted / "checkpoints" / "step-0000008" / "model.safetensors")
    assert any(not torch.equal(ours[key], theirs[key]) for key in ours)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.name=SiT-S/2", "model.name is 'DiT-S/2' in the checkpoint, not 'SiT-S/2'"),
        ("model.hidden_size=64", "model.hidden_size is 32 in the checkpoint, not 64"),
        ("model.vca.joint_softmax=false", "model.vca.joint_softmax is True in the checkpoint, not False"),
        ("diffusion.learn_sigma=true", "diffusion.learn_sigma is False in the checkpoint, not True"),
        ("data.num_classes=5", "data.num_classes is 10 in the checkpoint, not 5"),
        ("train.seed=1", "train.seed is 0 in the checkpoint, not 1"),
    ],
)
def test_resume_refuses_another_model_objective_data_or_seed(uninterrupted, tmp_path, override, message):
    from training.config import ConfigError

    run_dir = copy_run(uninterrupted, tmp_path / "run")
    before = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    with pytest.raises(ConfigError, match=f"--resume .*step-0000004: {message}; a resumed run keeps"):
        run_train(*ONE_PROCESS, f"run.dir={run_dir}", override, "--resume", "latest")
    assert {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()} == before


def test_overwrite_deletes_only_what_runs_write_and_names_what_stays(uninterrupted, tmp_path, capsys):
    run_dir = copy_run(uninterrupted, tmp_path / "run")
    (run_dir / "samples").mkdir()
    (run_dir / "exports").mkdir()
    mine = [
        run_dir / "samples" / "holiday.png",
        run_dir / "exports" / "report.pdf",
        run_dir / "checkpoints" / "mine.txt",
        run_dir / "notes.md",
    ]
    for path in mine:
        path.write_text("the user's")
    (run_dir / "samples" / "step-0000004.png").write_bytes(b"a grid of the earlier run")
    run_train(*ONE_PROCESS, f"run.dir={run_dir}", "train.max_steps=2", "log.checkpoint_every=2", "--overwrite")
    assert all(path.read_text() == "the user's" for path in mine)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["mine.txt", "step-0000002"]
    assert not (run_dir / "samples" / "step-0000004.png").exists()
    assert (
        "--overwrite: kept checkpoints/mine.txt, exports/report.pdf, samples/holiday.png (not written by a "
        "training run)" in capsys.readouterr().out
    )


def test_a_resume_removes_the_partial_folder_of_a_killed_save(uninterrupted, tmp_path):
    run_dir = copy_run(uninterrupted, tmp_path / "run")
    partial = run_dir / "checkpoints" / ".step-0000006.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 4096)  # what a save killed at step 6 leaves
    run_train(*ONE_PROCESS, f"run.dir={run_dir}", "--resume", "latest")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-0000004", "step-0000008"]


def test_a_latent_space_run_without_grids_or_fid_needs_no_vae(tmp_path):
    latent_shards(tmp_path / "latents")
    run_dir = tmp_path / "run"
    run_train(
        *latent_run(tmp_path / "latents"),
        "train.max_steps=2",
        "log.every=1",
        "log.checkpoint_every=2",
        "log.sample_every=0",
        "log.fid_every=0",
        f"run.dir={run_dir}",
    )
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-0000002"]
    export = json.loads((run_dir / "checkpoints" / "step-0000002" / "export" / "config.json").read_text())
    assert export["class_names"] == ["a", "b", "c"]  # the image folder's, through the latents' manifest (for grids)


# --------------------------------------------------------------------------------------------------
#                          sample.py: nothing claimed before everything is checked
# --------------------------------------------------------------------------------------------------


SAMPLE_RUN = [
    "--num-samples",
    "8",
    "--shard-size",
    "4",
    "--per-proc-batch-size",
    "4",
    "--grid-size",
    "4",
    "--sampler",
    "ddim",
    "--steps",
    "3",
]


@pytest.fixture
def sample_script():
    import sample

    def run(*arguments: str) -> None:
        try:
            sample.main([*arguments])
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)

    return run


@pytest.mark.parametrize(
    "options, message",
    [
        (["--eta", "-1"], "DDIM eta must be >= 0, got -1.0"),
        (["--steps", "5000"], "no integer stride gives exactly 5000 of 1000 steps"),
    ],
)
def test_a_sampler_option_out_of_range_fails_before_the_folder_is_claimed(
    sample_script, export, tmp_path, options, message
):
    out = tmp_path / "samples.npz"
    with pytest.raises(SampleError, match=f"--sampler ddim with these options: .*{message}"):
        sample_script("--ckpt", str(export), "--out", str(out), *SAMPLE_RUN, *options)
    assert list(tmp_path.iterdir()) == []
    sample_script("--ckpt", str(export), "--out", str(out), *SAMPLE_RUN)  # the corrected rerun
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.json", "samples.npz", "samples.png"]


def test_a_folder_without_a_finished_shard_is_not_another_runs(tmp_path):
    from atomic_files.shards import ShardFolder

    names = ["shard-0.npz", "shard-1.npz"]
    ShardFolder(tmp_path / "out.shards", names, {"eta": -1}).claim()  # a run that failed before any shard
    assert ShardFolder(tmp_path / "out.shards", names, {"eta": 0}).claim() == [0, 1]
    assert json.loads((tmp_path / "out.shards" / "settings.json").read_text()) == {"eta": 0}


def test_an_export_with_non_finite_weights_is_refused_when_it_loads(sample_script, export, tmp_path):
    import shutil

    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    shutil.copytree(export, broken)
    weights = load_file(broken / "ema.safetensors")
    key = sorted(weights)[0]
    weights[key] = weights[key].clone().fill_(float("nan"))
    save_file(weights, broken / "ema.safetensors")
    out = tmp_path / "out" / "samples.npz"
    out.parent.mkdir()
    with pytest.raises(SampleError, match=f"--ckpt: .*ema.safetensors: weight '{key}' holds NaN or infinite values"):
        sample_script("--ckpt", str(broken), "--out", str(out), *SAMPLE_RUN)
    assert list(out.parent.iterdir()) == []


def test_sampling_into_a_read_only_folder_fails_before_the_checkpoint_loads(
    sample_script, export, tmp_path, monkeypatch
):
    import sample

    monkeypatch.setattr(sample, "load_checkpoint", lambda args: pytest.fail("the checkpoint was loaded"))
    failing_writes(monkeypatch, errno.EROFS)
    with pytest.raises(OutputError, match="read-only file system"):
        sample_script("--ckpt", str(export), "--out", str(tmp_path / "samples.npz"), *SAMPLE_RUN)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fail_at", ["shard", "merge"])
def test_a_full_disk_while_sampling_keeps_finished_shards_and_the_rerun_completes(
    sample_script, export, tmp_path, monkeypatch, fail_at
):
    import numpy as np

    reference = tmp_path / "reference" / "samples.npz"
    reference.parent.mkdir()
    everything = failing_writes(monkeypatch, errno.ENOSPC, after_bytes=10**9)  # counts what a whole run writes
    sample_script("--ckpt", str(export), "--out", str(reference), *SAMPLE_RUN)
    written = 10**9 - everything.left
    monkeypatch.undo()
    out = tmp_path / "run" / "samples.npz"
    out.parent.mkdir()
    # settings.json and half the first shard; or all but the second half of the merged file (written last)
    room = {"shard": 700, "merge": written - reference.stat().st_size // 2}[fail_at]
    budget = failing_writes(monkeypatch, errno.ENOSPC, after_bytes=room)
    with pytest.raises(OutputError, match=r"cannot write .*: no space left on its disk \("):
        sample_script("--ckpt", str(export), "--out", str(out), *SAMPLE_RUN)
    assert (
        budget.failures[-1].name.lstrip(".").startswith({"shard": "shard-000000.npz", "merge": "samples.npz"}[fail_at])
    )
    left = sorted(p.name for p in (out.parent / "samples.npz.shards").iterdir())
    assert not any(".tmp-" in name for name in left)  # no partial file
    assert not out.exists()
    monkeypatch.undo()
    sample_script("--ckpt", str(export), "--out", str(out), *SAMPLE_RUN)
    with np.load(out) as ours, np.load(reference) as theirs:
        assert np.array_equal(ours["arr_0"], theirs["arr_0"]) and np.array_equal(ours["arr_1"], theirs["arr_1"])


@pytest.mark.parametrize(
    "override, message",
    [
        # the width's split into heads is a config check (training.config), before the data are loaded
        ("model.num_heads=3", "'model.num_heads' is 3, but DiT-S/2 with model.hidden_size=32 cannot be split into 3"),
        (
            "model.vca.contrast_grid=3",
            "model settings that build no model for 1x8x8 inputs: contrast_grid=3 must be a positive divisor of the "
            "token grid side 4",
        ),
    ],
)
def test_model_settings_that_build_no_model_are_one_line_before_anything_is_written(tmp_path, override, message):
    from training.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        run_train(*[a for a in ONE_PROCESS if a != "model.num_heads=2"], override, f"run.dir={tmp_path / 'run'}")
    assert list(tmp_path.iterdir()) == []


def test_an_export_whose_description_builds_no_model_is_one_line(sample_script, export, tmp_path):
    import shutil

    out = tmp_path / "out" / "samples.npz"
    out.parent.mkdir()
    # Sizes that do not fit together are refused as the description is read (its model is resolved there); a VCA
    # contrast grid that does not tile the token grid (4x4 here) as the model is built.
    for key, value, message in (
        ("num_heads", 3, "config.json is not an export description .*not divisible by num_heads=3"),
        ("vca", {"contrast_grid": 3}, "its description builds no model .*contrast_grid=3"),
    ):
        broken = tmp_path / f"broken-{key}"
        shutil.copytree(export, broken)
        description = json.loads((broken / "config.json").read_text())
        description["model"][key] = value
        (broken / "config.json").write_text(json.dumps(description))
        with pytest.raises(UserError, match=message):  # SampleError, or the description's ExportError
            sample_script("--ckpt", str(broken), "--out", str(out), *SAMPLE_RUN)
        assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize(
    "damage, message",
    [
        ("cut", "cannot be read"),
        ("shape", r"holds \{'mean': \[8, 2, 4, 2, 2\]"),
        ("labels", "holds labels 0..7; data.num_classes=3 allows 0..2"),
    ],
)
def test_damaged_latent_shards_are_named_before_training(tmp_path, damage, message):
    from safetensors.torch import save_file

    from training.data import LatentShardError

    means, stds = latent_shards(tmp_path / "latents")
    shard = tmp_path / "latents" / "shard-00001.safetensors"
    if damage == "cut":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "shape":
        save_file(
            {
                "mean": means[8:, :, :, :2, :2].contiguous(),
                "std": stds[8:, :, :, :2, :2].contiguous(),
                "labels": torch.arange(8),
            },
            shard,
        )
    else:
        save_file({"mean": means[8:], "std": stds[8:], "labels": torch.arange(8)}, shard)
    with pytest.raises(LatentShardError, match=f"latent shard {shard} {message}"):
        run_train(
            *latent_run(tmp_path / "latents"),
            "train.max_steps=2",
            "log.sample_every=0",
            f"run.dir={tmp_path / 'run'}",
        )
    assert not (tmp_path / "run").exists()


def test_checkpoint_files_of_another_model_are_one_line(uninterrupted, tmp_path):
    from safetensors.torch import save_file

    from training.checkpoint_folders import CheckpointError

    run_dir = copy_run(uninterrupted, tmp_path / "run")
    weights = load_file(run_dir / "checkpoints" / "step-0000004" / "model.safetensors")
    save_file(
        {key: value[..., :1].contiguous() if value.ndim else value for key, value in weights.items()},
        run_dir / "checkpoints" / "step-0000004" / "model.safetensors",
    )  # valid file, other shapes
    with pytest.raises(CheckpointError, match="cannot resume from .*step-0000004: its files belong to another model"):
        run_train(*ONE_PROCESS, f"run.dir={run_dir}", "--resume", "latest")


def test_fid_statistics_with_unreadable_arrays_are_one_line(fid_inputs, tmp_path):
    import numpy as np

    import fid.__main__ as fid_command
    from fid.errors import InputError

    samples, ref = fid_inputs
    objects = tmp_path / "objects.npz"
    np.savez(objects, mu=np.array([None] * 3, dtype=object), sigma=np.eye(3))  # loads only by unpickling
    with pytest.raises(InputError, match=f"{objects}: 'mu'/'sigma' cannot be read as numbers"):
        fid_command.main([str(objects), str(ref), "--metrics", "fid"])


def test_a_vae_folder_that_cannot_be_loaded_is_one_line(tmp_path):
    from generation.vae import VAEUnavailableError, load_vae

    folder = tmp_path / "vae"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # a config without its weights
    with pytest.raises(VAEUnavailableError, match=f"VAE folder {folder} cannot be loaded \\(.*no file named"):
        load_vae(str(folder), "cpu")


def test_a_second_run_into_a_claimed_shard_folder_is_refused_at_once(tmp_path):
    from atomic_files.shards import ShardFolder

    names = ["shard-0.npz", "shard-1.npz"]
    first = ShardFolder(tmp_path / "out.shards", names, {"seed": 0})
    assert first.claim() == [0, 1]
    holder = subprocess.run(  # another process, as a second sample.py would be
        [
            sys.executable,
            "-c",
            "import sys; from atomic_files.shards import ShardFolder\n"
            "try:\n    ShardFolder(sys.argv[1], ['shard-0.npz', 'shard-1.npz'], {'seed': 0}).claim()\n"
            "except Exception as error:\n    print(type(error).__name__, error)",
            str(tmp_path / "out.shards"),
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "ShardFolderError" in holder.stdout and "is being written by another run right now" in holder.stdout
    first.release()  # the first run ends (so does its lock when the process ends)
    assert ShardFolder(tmp_path / "out.shards", names, {"seed": 0}).claim() == [0, 1]


def test_a_claimed_shard_folder_names_the_process_that_holds_it(tmp_path):
    # sample.py, training.latents and train.py share one lock (atomic_files.folder_lock); each refusal names the
    # process, as /proc/locks lists it.
    from atomic_files.shards import ShardFolder

    folder = ShardFolder(tmp_path / "out.shards", ["shard-0.npz"], {"seed": 0})
    folder.claim()
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from atomic_files.shards import ShardFolder\n"
                "try:\n    ShardFolder(sys.argv[1], ['shard-0.npz'], {'seed': 0}).claim()\n"
                "except Exception as error:\n    print(error)",
                str(tmp_path / "out.shards"),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        folder.release()
    assert f"is being written by another run right now (process {os.getpid()})" in second.stdout, second.stderr


@pytest.mark.parametrize(
    "message, expected",
    [
        ("Error while serializing: I/O error: No space left on device (os error 28)", "no space left on its disk"),
        (
            "PytorchStreamWriter failed writing file data/0: Read-only file system (os error 30)",
            "read-only file system",
        ),
    ],
)
def test_writers_without_an_errno_are_recognised(tmp_path, message, expected):
    # Measured on a 560 KiB tmpfs: safetensors reports a full disk as SafetensorError with this text, no errno.
    from atomic_files import output_error

    described = output_error(tmp_path / "file", Exception(message))
    assert isinstance(described, OutputError) and expected in str(described)
    assert output_error(tmp_path / "file", Exception("a bug")) is None


def test_demo_into_a_read_only_folder_fails_before_training(tmp_path, monkeypatch):
    import demo

    monkeypatch.setattr(demo, "train", lambda *a: pytest.fail("the demo trained"))
    failing_writes(monkeypatch, errno.EROFS)
    with pytest.raises(OutputError, match="read-only file system"):
        demo.main(["--out", str(tmp_path / "demo")])
    assert list(tmp_path.iterdir()) == []


def test_latent_extraction_writes_nothing_before_the_vae_has_loaded(tmp_path):
    from generation.vae import VAEUnavailableError
    from training.config import load_config
    from training.latents import extract_latents

    images = make_images(tmp_path / "images", per_class=2)
    config = load_config(extraction_config(tmp_path, images, tmp_path / "latents", tmp_path / "no-vae"))
    with pytest.raises(VAEUnavailableError, match="does not exist"):
        extract_latents(config)
    assert not (tmp_path / "latents").exists()


# --------------------------------------------------------------------------------------------------
#                      Durable writes: flushed before the rename, in the umask's mode
# --------------------------------------------------------------------------------------------------


class DiskLog:
    """Records every fsync (by the path of its descriptor) and every os.replace, with what under the renamed file
    or folder had not been flushed when it was renamed."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, str]] = []
        self.unflushed: dict[str, list[str]] = {}  # target of a rename -> paths renamed with it, never flushed
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(descriptor: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
            real_fsync(descriptor)

        def replace(source, target, **options) -> None:
            source, target = os.path.abspath(source), os.path.abspath(target)
            inside = [source] + [str(path) for path in Path(source).rglob("*")] if os.path.isdir(source) else [source]
            flushed = {path for kind, path in self.events if kind == "fsync"}
            self.unflushed[target] = [path for path in inside if path not in flushed]
            self.events.append(("replace", target))
            real_replace(source, target, **options)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def durable(self, target: Path) -> bool:
        """Whether everything `target` was renamed from (every file and folder of a folder) was flushed before the
        rename, and the folder holding it after (the rename itself)."""
        renamed = self.events.index(("replace", str(target)))
        return self.unflushed[str(target)] == [] and ("fsync", str(target.parent)) in self.events[renamed + 1 :]


def test_a_file_is_flushed_before_its_rename_and_its_folder_after(tmp_path, monkeypatch):
    # Before: os.replace alone, so a crash of the machine could keep the name and lose the bytes.
    from atomic_files import atomic_folder, write_text_atomic

    log = DiskLog(monkeypatch)
    write_text_atomic(tmp_path / "note.txt", "whole\n")
    temporary = str(tmp_path / f".note.txt.tmp-{os.getpid()}")
    assert log.events == [("fsync", temporary), ("replace", str(tmp_path / "note.txt")), ("fsync", str(tmp_path))]
    with atomic_folder(tmp_path / "folder") as folder:
        (folder / "inner").mkdir()
        (folder / "inner" / "a.bin").write_bytes(b"a")
        write_text_atomic(folder / "b.txt", "b")  # flushed with the folder, not before
    assert log.durable(tmp_path / "folder")


@pytest.mark.slow
def test_checkpoints_exports_and_snapshots_are_flushed_before_they_take_their_names(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    log = DiskLog(monkeypatch)
    run_train(
        *("--config", str(ROOT / "configs" / "digits.yaml"), f"run.dir={run_dir}"),
        *("model.hidden_size=32", "model.depth=1", "model.num_heads=2", "train.global_batch_size=16"),
        *("train.max_steps=2", "log.checkpoint_every=2", "log.export_every=2", "log.sample_every=0"),
        *("log.trackers=[]", "train.posthoc_ema.sigma_rel=[0.1]", "train.posthoc_ema.snapshot_every=2"),
    )
    # every file and folder of each, Accelerate's optimizer.bin and RNG states too
    for folder in ("checkpoints/step-0000002", "exports/step-0000002", "posthoc_ema/step-0000002", "config.yaml"):
        assert log.durable(run_dir / folder), folder


def test_written_files_take_the_umasks_mode(tmp_path):
    # safetensors creates its files 0o600 whatever the umask (before: so were every export and checkpoint).
    import torch
    from safetensors.torch import save_file

    from atomic_files import atomic_folder, atomic_output

    previous = os.umask(0o002)  # a group-shared run directory
    try:
        with atomic_output(tmp_path / "ema.safetensors") as temporary:
            save_file({"w": torch.zeros(2)}, temporary)
        with atomic_folder(tmp_path / "checkpoint") as folder:
            save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    finally:
        os.umask(previous)
    for path in (tmp_path / "ema.safetensors", tmp_path / "checkpoint" / "model.safetensors"):
        assert oct(path.stat().st_mode & 0o777) == oct(0o664), path
