"""sweep.py: many exports x guidance x scale sampled and scored in one process, with the numbers of separate
sample.py and `python -m fid` runs; resumable; post-hoc EMA lengths of a run as exports; user errors in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
import sweep
from _tiny_models import tiny_export
from commands import USER_ERROR_STATUS, run_command
from fid.__main__ import main as fid_main
from scored_points import FidScorer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SAMPLE_OPTIONS = ["--sampler", "ddim", "--steps", "2", "--per-proc-batch-size", "3", "--cpu", "--grid-size", "0"]


@pytest.fixture
def reference(tmp_path) -> Path:
    """REF: pool_3 statistics (a Gaussian of 2048-d features), so that only the samples go through Inception."""
    path = tmp_path / "ref.npz"
    features = np.random.default_rng(0).gamma(2.0, 0.2, (16, 2048))  # (N, 2048): non-negative, like pool_3
    np.savez(path, mu=features.mean(0), sigma=np.cov(features, rowvar=False))
    return path


def sweep_arguments(tmp_path: Path, export: Path, reference: Path, guidance=("none", "cfg")) -> list[str]:
    return [
        "--ckpt",
        f"tiny={export}",
        "--guidance",
        *guidance,
        "--scales",
        "2",
        "--ref",
        str(reference),
        "--num-samples",
        "3",
        "--out",
        str(tmp_path / "sweep"),
        "--",
        *SAMPLE_OPTIONS,
    ]


@pytest.mark.slow
def test_a_sweep_scores_each_point_as_sample_py_and_python_m_fid_do_and_resumes(tmp_path, reference, capsys):
    export = tiny_export(tmp_path / "export")
    out = tmp_path / "sweep"
    (first,) = sweep.main(sweep_arguments(tmp_path, export, reference, guidance=("cfg",)))

    # The same point as two separate commands: sample.py, then python -m fid.
    separate = tmp_path / "separate.npz"
    sample.main(
        ["--ckpt", str(export), "--cfg-scale", "2", "--num-samples", "3", "--out", str(separate), *SAMPLE_OPTIONS]
    )
    report = fid_main([str(separate), str(reference), "--metrics", "fid"])
    with np.load(separate) as theirs, np.load(first["samples"]) as ours:
        np.testing.assert_array_equal(ours["arr_0"], theirs["arr_0"])
        np.testing.assert_array_equal(ours["arr_1"], theirs["arr_1"])
    assert first["metrics"] == {"fid": report["fid"]}  # equal, not close: the same code on the same images
    assert first["inception_weights"] == report["inception_weights"]

    table = (out / "sweep.md").read_text()
    assert f"| tiny | n/a | cfg | 2 | {first['metrics']['fid']:.4f} |" in table  # an export without training step
    assert json.loads((out / "sweep.json").read_text())["points"] == [first]
    assert (out / "sweep.png").read_bytes().startswith(PNG_SIGNATURE)

    # A rerun reads every point scored with these settings back and samples and scores nothing (each point's record
    # is written once it is scored: a sweep killed after some points continues with the others).
    record = out / "scores" / "tiny-cfg2.json"
    stamp = record.stat().st_mtime_ns
    capsys.readouterr()
    assert sweep.main(sweep_arguments(tmp_path, export, reference, guidance=("cfg",))) == [first]
    printed = capsys.readouterr().out
    assert "sampling and scoring" not in printed and record.stat().st_mtime_ns == stamp
    # and says so (issue 48: a resumed sweep did not say how many points it skipped)
    assert f"sweep: 1 of 1 points already scored with these settings in {out}: read back, not sampled again" in printed

    # Other sample.py options into the same --out: sample.py refuses before sampling (a sweep never overwrites).
    error = sweep_one_line_error(
        [*sweep_arguments(tmp_path, export, reference, guidance=("cfg",)), "--steps", "3"], capsys
    )
    assert "belongs to a run with steps=2, not 3" in error


@pytest.mark.slow
def test_a_sweep_warns_of_small_sets_once_and_its_plot_names_the_sample_count(tmp_path, reference, capsys):
    """Issue 48: fid's small-set warning came once per point; the plot did not say how many samples each FID is
    of. A resumed sweep with one more point says it kept the first."""
    export = tiny_export(tmp_path / "export")
    records = sweep.main(sweep_arguments(tmp_path, export, reference, guidance=("none", "cfg")))
    assert len(records) == 2
    warned = [line for line in capsys.readouterr().err.splitlines() if "FID is biased upwards" in line]
    assert len(warned) == 1 and "3 images; with fewer than 2048 per set" in warned[0]
    assert sweep.plot(records).axes[0].get_title() == "FID of 3 samples per point against the guidance scale"
    sweep.main(sweeping(sweep_arguments(tmp_path, export, reference), "--scales", "2", "3"))  # the later --scales
    printed = capsys.readouterr().out
    assert "sweep: 2 of 3 points already scored" in printed and "sweep: sampling and scoring tiny, cfg 3 (3" in printed


def posthoc_run(run_dir: Path, export: Path) -> None:
    """A run folder with post-hoc EMA snapshots of the tiny model at steps 1-3 (two profiles each), written by
    the training code's own tracker (training.power_ema.PowerEMA) as the weights move."""
    from generation import read_export
    from generation.generator import load_model
    from training.config import PosthocEMAConfig
    from training.power_ema import PowerEMA

    tiny = read_export(export)
    model = load_model(tiny).requires_grad_(True)
    tracker = PowerEMA(model, PosthocEMAConfig(sigma_rel=[0.05, 0.1], snapshot_every=1), batch=8)
    generator = torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
        tracker.update(model)
        tracker.save_snapshot(run_dir, step, tiny.description)


@pytest.mark.slow
def test_post_hoc_ema_lengths_of_a_run_are_reconstructed_once_and_swept(tmp_path, reference, capsys):
    from generation import read_export
    from generation.run_layout import POSTHOC_EXPORTS_FOLDER as DEFAULT_OUT

    run_dir = tmp_path / "run"
    posthoc_run(run_dir, tiny_export(tmp_path / "export"))
    arguments = [
        *("--run", str(run_dir), "--sigma-rel", "0.07", "--step", "2", "--guidance", "none"),
        *("--ref", str(reference), "--num-samples", "3", "--out", str(tmp_path / "sweep"), "--", *SAMPLE_OPTIONS),
    ]
    (record,) = sweep.main(arguments)
    assert "| sigma_rel 0.07 | 2 | none | 1 |" in (tmp_path / "sweep" / "sweep.md").read_text()
    folder = run_dir / DEFAULT_OUT / "sigma_rel-0.07-step-0000002"
    assert record["point"]["ckpt"] == str(folder) and record["point"]["label"] == "sigma_rel 0.07"
    assert read_export(folder).description.posthoc_ema["step"] == 2 and record["train_step"] == 2
    assert "reconstructing sigma_rel 0.07" in capsys.readouterr().out
    stamp = (folder / "ema.safetensors").stat().st_mtime_ns
    sweep.main(arguments)
    assert "reconstructing" not in capsys.readouterr().out
    assert (folder / "ema.safetensors").stat().st_mtime_ns == stamp


def sweeping(arguments: list[str], *more: str) -> list[str]:
    """`arguments` with more sweep arguments (before the sample.py options after `--`)."""
    split = arguments.index("--")
    return [*arguments[:split], *more, *arguments[split:]]


def sweep_one_line_error(arguments: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        run_command(sweep.main, arguments)
    assert exit_.value.code == USER_ERROR_STATUS
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1, error
    return error


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda a: a[2:], "nothing to sweep"),  # no --ckpt
        (lambda a: sweeping(a, "--guidance", "autoguidance"), "--guidance autoguidance and --guide-ckpt"),
        (lambda a: sweeping(a, "--scales", "1", "-1"), "--scales: -1.0 is not a finite number"),
        (lambda a: [*a, "--cfg-scale", "3"], "give --cfg-scale, which each point sets itself"),
        (lambda a: [*a, "--guid", "x"], "give --guid, which each point sets itself"),  # argparse's abbreviation
        (lambda a: [*a, "--steps", "0"], "--steps must be positive"),
        (lambda a: [*a, "--sampler-steps", "3"], "unrecognized arguments: --sampler-steps 3 (see sample.py --help)"),
        (lambda a: [x.replace("ref.npz", "missing.npz") for x in a], "missing.npz: no such file or folder"),
        (lambda a: sweeping(a, "--metrics", "fid,prc"), "precision/recall needs images"),  # REF: statistics
        (lambda a: sweeping(a, "--run", "nowhere"), "--run and --sigma-rel come together"),
        (lambda a: sweeping(a, "--ckpt", "a=x", "a=y"), "two exports are named 'a'"),
    ],
)
def test_a_sweep_that_cannot_run_is_refused_in_one_line_before_any_sampling(tmp_path, reference, change, named, capsys):
    arguments = change(sweep_arguments(tmp_path, tmp_path / "export", reference))
    assert named in sweep_one_line_error(arguments, capsys)
    assert not (tmp_path / "sweep" / "scores").exists()


def test_a_launch_of_several_processes_is_refused(tmp_path, reference, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun or accelerate launch set it in each process
    arguments = sweep_arguments(tmp_path, tmp_path / "export", reference)
    assert "sweep.py runs as one process" in sweep_one_line_error(arguments, capsys)


# ----------------------------------------------------------------------------------------------------------------
# Issue 47: every input checked before the first point; one sweep per --out; only its own files replaced; the
# weights behind each score
# ----------------------------------------------------------------------------------------------------------------


def nan_export(folder: Path) -> Path:
    from generation.export import read_export, write_export

    export = read_export(tiny_export(folder))
    weights = {key: value.clone() for key, value in export.weights.items()}
    next(value for value in weights.values() if value.is_floating_point()).view(-1)[0] = float("nan")
    write_export(folder, weights, export.description)
    return folder


@pytest.mark.parametrize(
    "second, options, named",
    [
        (lambda folder: folder, [], "--ckpt: {second}: no such file or folder"),  # never written
        (nan_export, [], "holds NaN or infinite values"),
        (lambda folder: tiny_export(folder, family="SiT"), [], "--sampler 'ddim': this checkpoint's objective offers"),
        (tiny_export, ["--num-samples", "1"], "--num-samples 1: 1 image(s); feature statistics"),
    ],
)
def test_every_export_and_option_is_checked_before_the_first_point(tmp_path, reference, capsys, second, options, named):
    """Issue 47: sweep.py checked its second and later --ckpt (a missing path, NaN weights, another objective's
    sampler) and --num-samples 1 only when it reached them, after the earlier points had been sampled and scored;
    its help says such errors come first. Now nothing is sampled."""
    first = tiny_export(tmp_path / "first")
    other = second(tmp_path / "second")
    arguments = sweep_arguments(tmp_path, first, reference, guidance=("none",))
    arguments = sweeping(arguments, "--ckpt", f"first={first}", f"second={other}", *options)
    error = sweep_one_line_error(arguments, capsys)
    assert named.format(second=other) in error, error
    assert not list((tmp_path / "sweep").rglob("*.npz*")) and not (tmp_path / "sweep" / "scores").exists()


def test_a_device_this_machine_lacks_is_one_line(tmp_path, reference, capsys):
    device = f"cuda:{torch.cuda.device_count()}"
    arguments = sweeping(sweep_arguments(tmp_path, tiny_export(tmp_path / "export"), reference), "--device", device)
    assert f"--device {device}: this machine has" in sweep_one_line_error(arguments, capsys)


def test_two_sweeps_into_one_out_are_refused(tmp_path, reference, capsys):
    """Issue 47: two sweeps into one --out sampled the same points side by side and kept only the last one's
    report. The first holds the folder's lock (atomic_files.folder_lock); the second stops at once."""
    import subprocess
    import sys

    out = tmp_path / "sweep"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from atomic_files.folder_lock import lock_folder; "
            "lock_folder(sys.argv[1]); print('held', flush=True); time.sleep(60)",
            str(out),
        ],
        cwd=Path(sweep.__file__).parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        error = sweep_one_line_error(sweep_arguments(tmp_path, tiny_export(tmp_path / "export"), reference), capsys)
        assert f"--out {out} is being written by another sweep.py right now (process {holder.pid})" in error
    finally:
        holder.kill()
        holder.wait()
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("name", ["sweep.md", "sweep.json", "scores/tiny-none.json"])
def test_a_sweep_replaces_only_files_it_wrote(tmp_path, reference, capsys, name):
    """Issue 47: the rule of every command that writes what a user names (atomic_files.ownership): a sweep.md of a
    user's (no sweep.json vouching for it), a sweep.json or a point's record that sweep.py did not write, stay;
    refused before anything is sampled."""
    mine = tmp_path / "sweep" / name
    mine.parent.mkdir(parents=True)
    mine.write_text('{"my": "notes"}\n')
    error = sweep_one_line_error(sweep_arguments(tmp_path, tiny_export(tmp_path / "export"), reference), capsys)
    assert f"{mine} exists and was not written by sweep.py; choose another --out" in error
    assert mine.read_text() == '{"my": "notes"}\n' and not list((tmp_path / "sweep").rglob("*.npz*"))


def test_a_point_of_an_export_replaced_in_place_is_not_read_back(tmp_path, reference, capsys, monkeypatch):
    """Issue 47: a rerun read back a point's score when its export's path was the same, though the weights there
    had been replaced. The record holds the weights' sha256 (the sampling settings of sample.py), so the rerun
    refuses, naming it, before anything is sampled (the point's samples are the old weights')."""
    monkeypatch.setattr(FidScorer, "score", lambda self, samples: ({"fid": 1.0}, "stand-in"))  # no Inception
    export = tiny_export(tmp_path / "export", seed=0)
    arguments = sweep_arguments(tmp_path, export, reference, guidance=("none",))
    (first,) = sweep.main(arguments)
    assert len(first["sampling"]["weights_sha256"]) == 64
    tiny_export(export, seed=1)
    record = tmp_path / "sweep" / "scores" / "tiny-none.json"
    before = record.read_bytes()
    capsys.readouterr()
    error = sweep_one_line_error(arguments, capsys)
    assert "tiny-none.json belongs to a run with weights_sha256=" in error
    assert record.read_bytes() == before
