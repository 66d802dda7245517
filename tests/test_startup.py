"""What train.py says before its first step (the start-up summary, printed and kept as <run>/startup.txt), and
the launches it refuses because they would not run the processes asked for."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from safetensors.torch import load_file

from _launch import TORCHRUN_TWO_PROCESSES
from _tiny_runs import run_train, summary_rows
from commands import USER_ERROR_STATUS
from dit_vca.model_spec import ModelSpec
from training.loop import TrainerState
from training.summary import describe_model, describe_resume

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"
TINY = [
    "--config",
    str(DIGITS),
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "train.global_batch_size=64",
    "log.checkpoint_every=2",
    "log.sample_every=0",
    "log.trackers=[]",
]


def test_the_startup_summary_says_what_the_run_will_do_and_is_kept(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_train(*TINY, "train.max_steps=2", f"run.dir={run_dir}")
    printed = capsys.readouterr().out
    rows = summary_rows(printed)
    weights = load_file(run_dir / "checkpoints" / "step-0000002" / "export" / "ema.safetensors")
    total = sum(tensor.numel() for tensor in weights.values())  # every parameter, counted from the saved file
    attention = sum(tensor.numel() for key, tensor in weights.items() if ".attn." in key)
    assert rows["model"].startswith(  # what was built, not the preset DiT-S/2 (12 blocks of width 384)
        f"DiT-S/2 resized to depth 1, width 32, 2 heads, MLP ratio 4 (the name's: 12, 384, 6, 4), "
        f"attention vca: {total:,} parameters"
    )
    assert rows["model"].endswith(f"attention layers {attention:,})") and attention > 0
    assert rows["objective"] == "DDPM, 1000 linear-beta steps, t uniform over them; predicts epsilon, loss MSE"
    assert rows["latents"] == "none: the model works on pixels in [-1, 1]"
    assert rows["data"] == "digits (built in): 1,797 images in 10 classes, 8 px"
    assert rows["loader"] == "in the training process (data.num_workers=0)"
    assert rows["batch"] == "1 process(es) x 64 micro-batch x 1 accumulation = 64 global batch"
    # train.tf32 is on, but only CUDA has it
    assert rows["precision"] == "fp32, TF32 unused on cpu, compile off, VCA kernel auto"
    assert rows["devices"] == "1 process on cpu"
    assert rows["run.dir"] == str(run_dir)
    assert rows["resumed from"] == "nothing (a fresh start at step 0)"
    # the digits recipe's warm-up EMA after 2 steps: d(2) = 1 - 2^-0.75 of the first step's weights (training.ema)
    assert rows["EMA"].startswith("decay 0.999, with warm-up (power 0.75); at step 2: 40.5 % the first step's weights")
    assert "grids and FID" not in rows  # log.sample_every=0, no FID
    warning = "warning: the EMA (train.ema_decay=0.999, with warm-up (power 0.75)) is still 40.5 % the first step's"
    kept = (run_dir / "startup.txt").read_text()
    assert kept in printed and summary_rows(kept) == rows and warning in kept

    run_train(*TINY, "train.max_steps=4", "train.grad_accum_steps=2", f"run.dir={run_dir}", "--resume", "latest")
    rows = summary_rows(capsys.readouterr().out)
    assert rows["batch"] == "1 process(es) x 32 micro-batch x 2 accumulation = 64 global batch"
    assert rows["resumed from"] == (
        f"{run_dir / 'checkpoints' / 'step-0000002'} at step 2; the checkpoint was "
        f"written with 1 process(es) x 64 micro-batch x 1 accumulation, this launch has "
        f"1 process(es) x 32 micro-batch x 2 accumulation, so the data position is "
        f"approximate"
    )


def test_a_changed_process_count_is_named():
    state = TrainerState(step=10, examples_seen=640, num_processes=1, micro_batch_size=64, grad_accum_steps=1)
    saved = {"step": 10, "examples_seen": 640, "num_processes": 2, "micro_batch_size": 32, "grad_accum_steps": 1}
    assert "written with 2 process(es) x 32 micro-batch" in describe_resume(Path("ckpt"), saved, state)
    assert (
        describe_resume(Path("ckpt"), {**saved, "num_processes": 1, "micro_batch_size": 64}, state) == "ckpt at step 10"
    )


def launch_cpu_only(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)},
    )


def test_accelerate_launch_cpu_with_two_processes_is_refused_with_the_command_that_works(tmp_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    result = launch_cpu_only(
        [
            str(accelerate),
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            "train.py",
            *TINY,
            "train.max_steps=1",
            f"run.dir={tmp_path}/run",
        ]
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and errors == [
        "error: accelerate launch --num_processes 2 started one process (with --cpu, Accelerate uses its "
        "single-process launcher); for 2 CPU processes run `torchrun --nproc_per_node 2 train.py ... "
        "train.cpu=true`"
    ], result.stderr
    assert f"exit status {USER_ERROR_STATUS}" in result.stderr  # what Accelerate reports of train.py
    assert not (tmp_path / "run").exists()


def test_torchrun_without_train_cpu_is_refused_once(tmp_path):
    result = launch_cpu_only(
        [
            *TORCHRUN_TWO_PROCESSES,
            "train.py",
            *TINY,
            "train.max_steps=1",
            f"run.dir={tmp_path}/run",
        ]
    )
    assert result.returncode != 0
    assert result.stderr.count("launched 2 processes but Accelerate sees one") == 1, result.stderr
    assert (
        "error: launched 2 processes but Accelerate sees one: on a machine without GPUs add train.cpu=true\n"
        in result.stderr
    )
    assert not (tmp_path / "run").exists()


def test_more_loader_workers_than_cpus_are_capped_and_the_summary_says_so(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    workers = cpus + 6  # torch warns of every loader with more workers than CPUs (as data.num_workers=8 on 2 CPUs)
    result = launch_cpu_only(
        [
            sys.executable,
            "train.py",
            *TINY,
            "train.max_steps=2",
            f"data.num_workers={workers}",
            f"run.dir={tmp_path}/run",
        ]
    )
    assert result.returncode == 0, result.stderr
    assert "This DataLoader will create" not in result.stderr, result.stderr
    loader = summary_rows(result.stdout)["loader"]
    assert loader == f"{cpus} worker processes (data.num_workers={workers}, capped at the {cpus} CPUs available)"


def test_a_model_of_the_names_own_sizes_is_named_alone():
    built = ModelSpec("SiT-XL/2").resolved()
    assert describe_model(built) == "SiT-XL/2"
    resized = describe_model(replace(built, mlp_ratio=2.0))
    assert resized.startswith("SiT-XL/2 resized to depth 28, width 1152, 16 heads")


def test_the_summary_states_a_swiglu_blocks_width_the_objective_and_the_latents():
    """Issue 48: the summary said "MLP ratio 4" for a SwiGLU block, and neither the objective nor the latents'
    normalisation. LightningDiT's recipe: SwiGLU of hidden width int(2/3 int(4 C)), rectified flow with
    logit-normal times and the direction loss, latents normalised per channel."""
    from generation.objective_builder import create_objective
    from generation.vae import LatentNormalization
    from training.build import objective_spec
    from training.config import load_config
    from training.summary import describe_latents, describe_objective

    built = ModelSpec("SiT-S/2", mlp="swiglu").resolved()
    assert describe_model(built) == "SiT-S/2 with swiglu (hidden width 1024)"
    assert describe_model(replace(built, depth=1, hidden_size=48, num_heads=2)) == (
        "SiT-S/2 with swiglu resized to depth 1, width 48, 2 heads, SwiGLU hidden width 128 (the name's: 12, 384, 6, "
        "1024)"
    )
    config = load_config("lightning-sit-s2-vca", ["data.latents=latents/imagenet256"])
    assert describe_objective(config, create_objective(objective_spec(config))) == (
        "interpolant, linear path (t = 0 noise, 1 data), velocity prediction, t logit-normal (location 0, scale 1) "
        "on [0, 1], loss velocity MSE + 1 x direction loss 1 - cos"
    )
    statistics = SimpleNamespace(normalization=LatentNormalization(1.0, (0.1, 0.2, 0.3, 0.4), (0.5, 1.0, 2.0, 4.0)))
    assert describe_latents(config, statistics) == (
        f"VAE {config.vae.name}: x = 1 (z - mean_c) / std_c per channel (vae.normalize=channels), the statistics of "
        "latents/imagenet256 (4 channels, std 0.5 to 4)"
    )
    sit = load_config("sit-s2-vca", ["data.latents=latents/imagenet256"])
    assert describe_latents(sit, SimpleNamespace(normalization=LatentNormalization(0.18215))) == (
        f"VAE {sit.vae.name}: x = 0.18215 z (vae.normalize=scale)"
    )
    assert describe_objective(sit, create_objective(objective_spec(sit))) == (
        "interpolant, linear path (t = 0 noise, 1 data), velocity prediction, t uniform on [0, 1], loss velocity MSE"
    )
    dit = load_config("dit-s2-vca", ["data.latents=latents/imagenet256"])
    assert describe_objective(dit, create_objective(objective_spec(dit))) == (
        "DDPM, 1000 linear-beta steps, t uniform over them; predicts epsilon and a learned-range variance, loss MSE "
        "+ variational bound (DiT's hybrid)"
    )
