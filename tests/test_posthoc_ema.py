"""Post-hoc EMA (EDM2): the profile mathematics against independent references, the tracker's discrete weights
against their closed form, the least-squares reconstruction, and (below) training runs that store profiles and the
command's one-line refusals of odd snapshot folders."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from scipy import integrate
from torch import nn

import sample
from _faults import signal_at_step
from _launch import TORCHRUN_TWO_PROCESSES
from _tiny_models import tiny_export
from _tiny_runs import run_train
from _user_errors import one_line_error
from generation import ImageGenerator, read_export
from generation.diffusers_interop import load_mhsa_model, to_diffusers
from generation.run_layout import POSTHOC_STATE as CHECKPOINT_STATE
from generation.run_layout import SNAPSHOT_FOLDER
from training.config import ConfigError, PosthocEMAConfig
from training.posthoc_ema import PosthocEMAError, reconstruct
from training.posthoc_ema import main as posthoc_main
from training.power_ema import PowerEMA
from training.power_profiles import (
    SIGMA_REL_MAX,
    gamma_to_sigma_rel,
    profile_inner_products,
    reconstruct_profile,
    sigma_rel_to_gamma,
)
from training.run import RunDirectory

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------------
#                                           Mathematics
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sigma_rel, gamma", [(0.05, 16.97), (0.10, 6.94)])
def test_sigma_rel_to_gamma_matches_the_values_edm2_lists(sigma_rel, gamma):
    # EDM2 (section 3) gives gamma to two decimals: half a unit of the last place.
    assert sigma_rel_to_gamma(sigma_rel) == pytest.approx(gamma, abs=0.005)


@pytest.mark.parametrize("sigma_rel", [0.001, 0.01, 0.05, 0.1, 0.2, 0.28])
def test_gamma_to_sigma_rel_inverts_sigma_rel_to_gamma(sigma_rel):
    gamma = sigma_rel_to_gamma(sigma_rel)
    assert gamma > 0
    assert gamma_to_sigma_rel(gamma) == pytest.approx(sigma_rel, rel=1e-12)  # float64 root finding


def test_sigma_rel_is_the_relative_width_of_the_profile():
    # Independent of the closed form: the standard deviation of tau under p(tau) = (g + 1) tau^g on [0, 1].
    for sigma_rel in (0.05, 0.1, 0.2):
        gamma = sigma_rel_to_gamma(sigma_rel)
        density = lambda tau, g=gamma: (g + 1) * tau**g  # noqa: E731
        mean = integrate.quad(lambda tau, d=density: tau * d(tau), 0, 1)[0]
        variance = integrate.quad(lambda tau, d=density, m=mean: (tau - m) ** 2 * d(tau), 0, 1)[0]
        assert math.sqrt(variance) == pytest.approx(sigma_rel, rel=1e-9)


@pytest.mark.parametrize("sigma_rel", [0.0, -0.1, SIGMA_REL_MAX, 0.3])
def test_sigma_rel_outside_its_range_is_refused(sigma_rel):
    with pytest.raises(ValueError, match="outside"):
        sigma_rel_to_gamma(sigma_rel)


def test_inner_products_of_profiles_equal_numerical_integrals():
    times, gammas = np.array([3.0e3, 7.5e3, 1.0e4]), np.array([16.97, 6.94, 2.5])
    closed = profile_inner_products(times, gammas, times, gammas)  # (3, 3)

    def profile(tau, t, g):
        return (g + 1) * tau**g / t ** (g + 1) if tau <= t else 0.0

    for a in range(3):
        for b in range(3):
            upper = min(times[a], times[b])
            numeric = integrate.quad(
                lambda tau, a=a, b=b: profile(tau, times[a], gammas[a]) * profile(tau, times[b], gammas[b]),
                0,
                upper,
                epsabs=0,
                epsrel=1e-12,
            )[0]
            assert closed[a, b] == pytest.approx(numeric, rel=1e-9)  # quad's own accuracy


def test_inner_products_do_not_overflow_at_imagenet_scale():
    # 1.3e9 images to the power 18 overflows float64 when squared; the ratio form does not.
    value = profile_inner_products([1.0e9], [16.97], [1.3e9], [16.97])
    assert np.isfinite(value).all() and value[0, 0] > 0


def test_a_stored_profile_reconstructs_as_itself():
    steps = np.arange(1, 17) * 100.0
    times, gammas = np.concatenate([steps, steps]), np.array([16.97] * 16 + [6.94] * 16)
    for k in (15, 31, 20):
        solution = reconstruct_profile(times, gammas, times[k], gammas[k])
        expected = np.zeros(32)
        expected[k] = 1.0
        # The Gram matrix's condition (about 1e7 here) times float64 rounding bounds the error of the solve.
        assert np.abs(solution.coefficients - expected).max() < 1e-6
        assert solution.relative_error < 1e-5


# --------------------------------------------------------------------------------------------------
#                                    The tracker's discrete weights
# --------------------------------------------------------------------------------------------------


class OneHotWeights(nn.Module):
    """A model whose weight vector at step i is the i-th unit vector: an average of it is its weights per step."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(steps))


def tracked_weights(sigma_rels, steps: int, batch: int) -> list[np.ndarray]:
    model = OneHotWeights(steps)
    tracker = PowerEMA(model, PosthocEMAConfig(sigma_rel=list(sigma_rels), snapshot_every=steps), batch)
    for i in range(steps):
        with torch.no_grad():
            model.weight.zero_()
            model.weight[i] = 1.0
        tracker.update(model)
    return [average[0].double().numpy() for average in tracker.averages]


@pytest.mark.parametrize("batch", [1, 64])
def test_the_tracked_average_weighs_step_i_as_the_closed_form_says(batch):
    steps = 200
    for sigma_rel, weights in zip((0.05, 0.1), tracked_weights((0.05, 0.1), steps, batch)):
        power = sigma_rel_to_gamma(sigma_rel) + 1
        i = np.arange(1, steps + 1, dtype=np.float64)
        expected = (i**power - (i - 1) ** power) / steps**power  # the same for any batch: (i*b)^p / (T*b)^p
        # float32 averages over 200 updates: each step rounds at 6e-8 relative; weights are <= 0.09.
        np.testing.assert_allclose(weights, expected, rtol=0, atol=2e-6)
        assert weights.sum() == pytest.approx(1.0, abs=1e-5)


def test_the_first_update_copies_the_weights():
    model = nn.Linear(3, 2)
    tracker = PowerEMA(model, PosthocEMAConfig(sigma_rel=[0.05], snapshot_every=1), batch=8)
    with torch.no_grad():
        model.weight.add_(1.0)
    tracker.update(model)
    assert torch.equal(tracker.averages[0][0], model.weight.detach())  # beta = 0 at the first step


@pytest.mark.parametrize("every, bound", [(16, 0.02), (8, 0.005)])
def test_profiles_reconstructed_from_two_others_match_the_discrete_weights(every, bound):
    # The whole chain on the weights of each step: snapshots of the profiles 0.05 and 0.10 every `every` of 256
    # steps (16 or 32 per profile), combined by the least-squares coefficients, against the profile 0.07 tracked
    # directly. Measured: the error is 1.4 % (16 snapshots) and 0.34 % (32) of the distance to the nearest stored
    # profile, 0.37 % and 0.094 % of the target's norm; the bounds leave a factor 1.5 for platforms.
    steps, batch = 256, 64
    stored = tracked_snapshots((0.05, 0.1), steps, every, batch)
    target = tracked_weights((0.07,), steps, batch)[0]
    times = np.array([step * batch for step, _, _ in stored], np.float64)
    gammas = np.array([sigma_rel_to_gamma(sigma_rel) for _, sigma_rel, _ in stored])
    solution = reconstruct_profile(times, gammas, steps * batch, sigma_rel_to_gamma(0.07))
    rebuilt = sum(c * weights for c, (_, _, weights) in zip(solution.coefficients, stored))
    nearest = min(np.linalg.norm(weights - target) for step, _, weights in stored if step == steps)
    error = np.linalg.norm(rebuilt - target)
    assert error < bound * nearest, (error, nearest)
    # The step-by-step weights are the continuous profile integrated over each step, so the continuous fit's
    # error predicts the discrete one (to 10 %: the integration over steps smooths a little).
    assert error / np.linalg.norm(target) == pytest.approx(solution.relative_error, rel=0.1)


def tracked_snapshots(sigma_rels, steps: int, every: int, batch: int) -> list[tuple[int, float, np.ndarray]]:
    model = OneHotWeights(steps)
    tracker = PowerEMA(model, PosthocEMAConfig(sigma_rel=list(sigma_rels), snapshot_every=every), batch)
    stored = []
    for i in range(steps):
        with torch.no_grad():
            model.weight.zero_()
            model.weight[i] = 1.0
        tracker.update(model)
        if (i + 1) % every == 0:
            stored += [(i + 1, s, avg[0].double().numpy().copy()) for s, avg in zip(sigma_rels, tracker.averages)]
    return stored


# --------------------------------------------------------------------------------------------------
#                                  Training runs that store profiles
# --------------------------------------------------------------------------------------------------

DIGITS = ROOT / "configs" / "digits.yaml"
# 64 steps of a tiny MHSA DiT (MHSA so that the diffusers converter takes its exports), three profiles, a snapshot
# every 2 steps: 32 per profile. The profile 0.07 is the reference its reconstruction from the other two must meet.
POSTHOC_RUN = [
    "--config",
    str(DIGITS),
    "model.attention=mhsa",
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "train.global_batch_size=64",
    "train.warmup_steps=5",
    "train.max_steps=64",
    "log.every=16",
    "log.checkpoint_every=1000",
    "log.sample_every=0",
    "log.trackers=[]",
    "train.posthoc_ema.sigma_rel=[0.05,0.1,0.07]",
    "train.posthoc_ema.snapshot_every=2",
]
PROFILES = ("0.05", "0.1", "0.07")


@pytest.fixture(scope="module")
def posthoc_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("posthoc") / "run"
    run_train(*POSTHOC_RUN, f"run.dir={run_dir}")
    return run_dir


def snapshot(run_dir: Path, step: int, sigma_rel: str) -> Path:
    return run_dir / SNAPSHOT_FOLDER / f"step-{step:07d}" / f"sigma_rel-{sigma_rel}.safetensors"


def distance(a: dict, b: dict) -> float:
    return math.sqrt(sum(float(((a[key].double() - b[key].double()) ** 2).sum()) for key in b))


def test_snapshots_are_stored_every_snapshot_every_steps_and_the_summary_gives_their_cost(posthoc_run):
    folders = sorted((posthoc_run / SNAPSHOT_FOLDER).iterdir())
    assert [folder.name for folder in folders] == [f"step-{step:07d}" for step in range(2, 65, 2)]
    for folder in folders:
        assert {path.name for path in folder.iterdir()} == {f"sigma_rel-{s}.safetensors" for s in PROFILES} | {
            "description.json"
        }
    with safe_open(snapshot(posthoc_run, 64, "0.07"), framework="pt") as header:
        assert header.metadata()["step"] == "64" and header.metadata()["images"] == str(64 * 64)
        assert float(header.metadata()["gamma"]) == sigma_rel_to_gamma(0.07)
    # The running state in the checkpoint is what the last snapshot stored (float32 both).
    state = load_file(posthoc_run / "checkpoints" / "step-0000064" / CHECKPOINT_STATE)
    last = load_file(snapshot(posthoc_run, 64, "0.07"))
    assert all(torch.equal(state[f"2/{key}"], value) for key, value in last.items())
    parameters = sum(value.numel() for value in last.values())
    summary = (posthoc_run / "startup.txt").read_text()
    assert f"{3 * parameters * 4 / 1e6:,.1f} MB each (float32), about 32 to step 64" in summary
    # --overwrite deletes the snapshots with the rest of the run.
    assert set(folders) <= set(RunDirectory(posthoc_run).written_by_runs())


def test_a_third_profile_reconstructed_from_two_others_equals_the_tracked_one(posthoc_run, tmp_path, capsys):
    run_dir = shutil.copytree(posthoc_run, tmp_path / "run")
    tracked = load_file(snapshot(run_dir, 64, "0.07"))
    stored = [load_file(snapshot(run_dir, 64, s)) for s in ("0.05", "0.1")]
    for file in (run_dir / SNAPSHOT_FOLDER).glob("*/sigma_rel-0.07.safetensors"):
        file.unlink()
    posthoc_main([str(run_dir), "--sigma-rel", "0.07", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "at step 64 from 64 stored profiles" in printed and "Gram condition" in printed

    export = read_export(tmp_path / "out" / "sigma_rel-0.07-step-0000064")
    error, nearest = distance(export.weights, tracked), min(distance(other, tracked) for other in stored)
    # Measured: 0.15 % of the distance to the nearest stored profile (2.4 % with every other snapshot, 16 per
    # profile), in line with the profile fit's 0.1 % relative error; 1 % leaves room for other platforms.
    assert error < 0.01 * nearest, (error, nearest)
    record = export.description.posthoc_ema
    assert record["sigma_rel"] == 0.07 and record["step"] == 64 and len(record["snapshots"]) == 64
    assert record["relative_error"] < 0.002 and record["condition"] > 1
    assert sum(entry["coefficient"] for entry in record["snapshots"]) == pytest.approx(1.0, abs=1e-3)
    assert export.description.train_step == 64

    # An export like every other: sample.py and the Python API sample it, the diffusers converter takes it.
    folder = tmp_path / "out" / "sigma_rel-0.07-step-0000064"
    out = tmp_path / "samples.npz"
    sample.main(["--ckpt", str(folder), "--out", str(out), "--num-samples", "2", "--steps", "3", "--grid-size", "0"])
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["train_step"] == 64 and summary["source"].startswith("post-hoc EMA sigma_rel 0.07 of ")
    generator = ImageGenerator.from_export(export)
    assert generator.generate([3, 4], [0, 1], steps=3).shape == (2, 8, 8, 3)
    transformer = to_diffusers(load_mhsa_model(folder))
    assert transformer.config.num_layers == 1


def test_a_stored_profile_of_a_run_reconstructs_as_itself(posthoc_run, tmp_path):
    (written,) = reconstruct(posthoc_run, [0.1], step=40, out=tmp_path)
    coefficients = {(entry["step"], entry["sigma_rel"]): entry["coefficient"] for entry in written.record["snapshots"]}
    assert max(step for step, _ in coefficients) == 40
    assert coefficients.pop((40, 0.1)) == pytest.approx(1.0, abs=1e-6)
    assert max(map(abs, coefficients.values())) < 1e-6  # the solve's rounding, amplified by the condition
    expected = load_file(snapshot(posthoc_run, 40, "0.1"))
    assert distance(read_export(written.folder).weights, expected) < 1e-5 * distance(
        expected, {k: 0 * v for k, v in expected.items()}
    )


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--sigma-rel", "0.3"], "--sigma-rel 0.3: expected a value in (0, 0.288675)"),
        (["--sigma-rel", "0.07", "--step", "3"], "--step 3: .* has no snapshot at that step; snapshot steps: 2, 4,"),
        (["--sigma-rel", "0.07", "--step", "2"], "--step 2: only 3 stored profile(s) at or before it"),
    ],
)
def test_reconstruction_refuses_what_it_cannot_do_in_one_line(posthoc_run, tmp_path, arguments, message):
    done = subprocess.run(
        [sys.executable, "-m", "training.posthoc_ema", str(posthoc_run), *arguments, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert re.search(message.replace("(", r"\(").replace(")", r"\)").replace("\\.*", ".*"), done.stderr), done.stderr
    assert not any(tmp_path.iterdir())


def test_reconstruction_of_a_run_without_profiles_is_refused(tmp_path):
    with pytest.raises(PosthocEMAError, match="holds no post-hoc EMA snapshots"):
        posthoc_main([str(tmp_path), "--sigma-rel", "0.07"])


def test_a_resume_is_bit_exact_and_takes_a_new_snapshot_every_from_then_on(posthoc_run, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    signal_at_step(monkeypatch, step=21, signals=["SIGTERM"])
    with pytest.raises(SystemExit):
        run_train(*POSTHOC_RUN, f"run.dir={run_dir}")
    monkeypatch.undo()
    run_train(*POSTHOC_RUN, f"run.dir={run_dir}", "train.posthoc_ema.snapshot_every=4", "--resume", "latest")
    steps = [int(folder.name[5:]) for folder in sorted((run_dir / SNAPSHOT_FOLDER).iterdir())]
    assert steps == [*range(2, 21, 2), *range(24, 65, 4)]  # every 2 up to the stop, every 4 after the resume
    for step in steps:
        for sigma_rel in PROFILES:
            assert_same_safetensors(snapshot(run_dir, step, sigma_rel), snapshot(posthoc_run, step, sigma_rel))
    name = f"checkpoints/step-0000064/{CHECKPOINT_STATE}"
    assert_same_safetensors(run_dir / name, posthoc_run / name)


def assert_same_safetensors(ours: Path, theirs: Path) -> None:
    """Tensors bit for bit and the same metadata (safetensors writes the metadata's keys in no fixed order)."""
    a, b = load_file(ours), load_file(theirs)
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), ours
    with safe_open(ours, framework="pt") as first, safe_open(theirs, framework="pt") as second:
        assert first.metadata() == second.metadata(), ours


def test_a_resume_with_other_profiles_is_refused_in_one_line(posthoc_run, tmp_path):
    run_dir = shutil.copytree(posthoc_run, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"profiles are train.posthoc_ema.sigma_rel=\[0.05, 0.1, 0.07\], this launch"):
        run_train(*POSTHOC_RUN, f"run.dir={run_dir}", "train.posthoc_ema.sigma_rel=[0.05]", "--resume", "latest")


def test_two_processes_hold_identical_profiles(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        *TORCHRUN_TWO_PROCESSES,
        str(ROOT / "tests" / "_posthoc_ranks.py"),
        *POSTHOC_RUN,
        "train.cpu=true",
        "train.grad_accum_steps=2",
        "train.max_steps=6",
        f"run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [load_file(run_dir / f"rank-{rank}.safetensors") for rank in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    saved = load_file(run_dir / "checkpoints" / "step-0000006" / CHECKPOINT_STATE)
    assert all(torch.equal(saved[key], value) for key, value in ranks[0].items())


def fake_snapshots(run_dir: Path, steps=(2, 4, 6, 8), sigma_rels=(0.05, 0.1), batch: int = 4) -> Path:
    """Post-hoc EMA snapshots as training stores them (headers, description.json last) of a one-tensor "model"."""
    from generation.export import read_description
    from generation.run_layout import SNAPSHOT_DESCRIPTION, SNAPSHOT_FOLDER, profile_file
    from generation.run_layout import step_name as snapshot_name
    from training.power_profiles import sigma_rel_to_gamma

    description = read_description(tiny_export(run_dir.parent / "snapshot-export")).to_json()
    generator = torch.Generator().manual_seed(0)
    for step in steps:
        folder = run_dir / SNAPSHOT_FOLDER / snapshot_name(step)
        folder.mkdir(parents=True)
        for sigma_rel in sigma_rels:
            header = {"sigma_rel": repr(sigma_rel), "gamma": repr(sigma_rel_to_gamma(sigma_rel)), "step": str(step)}
            weights = {"w": torch.randn(3, 3, generator=generator)}
            save_file(weights, folder / profile_file(sigma_rel), {**header, "images": str(step * batch)})
        (folder / SNAPSHOT_DESCRIPTION).write_text(json.dumps({**description, "train_step": step}))
    return run_dir


def test_posthoc_out_naming_a_file_is_one_line_and_the_file_stays(tmp_path, capsys):
    # Before: NotADirectoryError's traceback, from the staging folder made inside the file.
    from training.posthoc_ema import main as posthoc_main

    run_dir = fake_snapshots(tmp_path / "run")
    mine = tmp_path / "mine.txt"
    mine.write_text("not yours\n")
    for out in (mine, mine / "sub"):
        error = one_line_error(posthoc_main, [str(run_dir), "--sigma-rel", "0.07", "--out", str(out)], capsys)
        assert error == f"error: cannot write in {out}: {mine} is a file, not a folder; choose another place"
    assert mine.read_text() == "not yours\n"


def test_posthoc_list_of_a_run_with_a_cut_snapshot_is_one_line(tmp_path, capsys):
    # Cut anywhere (tried at every length of the file), a profile is named in one line.
    from training.posthoc_ema import main as posthoc_main

    run_dir = fake_snapshots(tmp_path / "run")
    cut = run_dir / "posthoc_ema" / "step-0000008" / "sigma_rel-0.1.safetensors"
    cut.write_bytes(cut.read_bytes()[:100])
    error = one_line_error(posthoc_main, [str(run_dir), "--list"], capsys)
    assert error.startswith(f"error: {cut} cannot be read as a post-hoc EMA snapshot (")


def test_a_snapshot_copied_into_another_steps_folder_is_refused(tmp_path, capsys):
    # Before: it entered the fit as a second copy of step 4's profiles (Gram condition 1.5e17), without a word.
    from training.posthoc_ema import main as posthoc_main

    run_dir = fake_snapshots(tmp_path / "run")
    snapshots = run_dir / "posthoc_ema"
    shutil.copytree(snapshots / "step-0000004", snapshots / "step-0000010")
    error = one_line_error(posthoc_main, [str(run_dir), "--sigma-rel", "0.07", "--out", str(tmp_path / "out")], capsys)
    copy = snapshots / "step-0000010" / "sigma_rel-0.05.safetensors"
    assert error == (
        f"error: {copy} holds the profile of step 4 (its header), not of step 10 (its folder): a snapshot copied "
        f"into another step's folder? Remove it"
    )
    assert not (tmp_path / "out").exists()


def test_an_incomplete_newest_snapshot_is_left_out_and_named_by_list(tmp_path, capsys):
    # Before: the folder without its description.json was the newest step, and the reconstruction failed on it.
    from training.posthoc_ema import main as posthoc_main
    from training.posthoc_ema import reconstruct

    run_dir = fake_snapshots(tmp_path / "run")
    fake_snapshots(tmp_path / "other", steps=(10,))
    shutil.copytree(tmp_path / "other" / "posthoc_ema" / "step-0000010", run_dir / "posthoc_ema" / "step-0000010")
    (run_dir / "posthoc_ema" / "step-0000010" / "description.json").unlink()
    (written,) = reconstruct(run_dir, [0.07], out=tmp_path / "out")
    assert written.record["step"] == 8
    posthoc_main([str(run_dir), "--list"])
    assert "left out, incomplete (no description.json): step-0000010" in capsys.readouterr().out


def test_snapshots_and_the_checkpoints_averages_are_byte_reproducible(tmp_path):
    """Issue 47: the same averages saved twice gave different bytes (safetensors writes its header's metadata in
    an order that changes from call to call), so a snapshot or posthoc_ema.safetensors could not be compared or
    checksummed. Saved four times, each file is the same four times."""
    from generation.export import read_description

    description = read_description(tiny_export(tmp_path / "export"))
    model = nn.Linear(3, 2)
    tracker = PowerEMA(model, PosthocEMAConfig(sigma_rel=[0.05, 0.1], snapshot_every=1), batch=4)
    tracker.update(model)
    contents = []
    for copy in range(4):
        folder = tracker.save_snapshot(tmp_path / f"run{copy}", 1, description)
        (tmp_path / f"checkpoint{copy}").mkdir()
        tracker.write_state(tmp_path / f"checkpoint{copy}")
        files = [*sorted(folder.iterdir()), tmp_path / f"checkpoint{copy}" / CHECKPOINT_STATE]
        contents.append([file.read_bytes() for file in files])
    assert all(copy == contents[0] for copy in contents[1:])
    with safe_open(tmp_path / "checkpoint0" / CHECKPOINT_STATE, framework="pt") as read:  # still readable as written
        assert json.loads(read.metadata()["sigma_rel"]) == [0.05, 0.1] and read.metadata()["images"] == "4"


def test_an_out_folder_that_is_not_a_reconstruction_is_never_replaced(posthoc_run, tmp_path, capsys):
    """The rule of every command that writes what a user names (atomic_files.ownership): a folder at the export's
    place that is not a post-hoc reconstruction (another export, a folder with a damaged config.json) stays."""
    for name, make in (("export", tiny_export), ("damaged", lambda folder: folder.mkdir(parents=True) or folder)):
        out = tmp_path / name
        target = make(out / "sigma_rel-0.07-step-0000064")
        (target / "config.json").write_text("{not json" if name == "damaged" else (target / "config.json").read_text())
        before = {path: path.read_bytes() for path in target.iterdir()}
        error = one_line_error(posthoc_main, [str(posthoc_run), "--sigma-rel", "0.07", "--out", str(out)], capsys)
        assert f"--out: {target} exists and was not written by python -m training.posthoc_ema" in error
        assert {path: path.read_bytes() for path in target.iterdir()} == before
