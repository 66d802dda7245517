"""Preemption on a real Slurm (issue 28): the batch scripts of docs/slurm/, submitted with sbatch to the single-host
Slurm of tests/cluster/slurm_up.sh, stopped the ways a scheduler stops jobs, requeued and resumed; the weights and
the logged metrics at the end equal an uninterrupted run's byte for byte, the samples equal an uninterrupted
sample.py's.

Where sbatch is missing (a laptop) the tests marked `slurm` are skipped; in CI (.ci/run sets VCA_REQUIRE_SLURM) a
Slurm that does not answer fails them.

Signals are the scheduler's own: `scancel --signal=USR1 --batch` (what `--signal=B:USR1@N` sends at the time
limit), the time-limit warning itself (`--signal=B:USR1@180` with the limit lowered while the job runs: slurmctld
checks limits every 30 s), and `scontrol requeue` (SIGTERM to every process of the job, KillWait, SIGKILL). A
requeued job waits before it may start again; `scontrol update StartTime=now` lets it start at once.
"""

import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from _launch import ROOT
from _slurm import (
    RUN,
    SCRIPTS,
    assert_same_as,
    job,
    pause,
    sbatch,
    scontrol,
    stops,
    text,
    wait_for_end,
    wait_for_requeue,
    wait_for_step,
    wait_until,
)
from _tiny_data import extraction_config, make_images
from _tiny_models import TINY_VAE, tiny_export
from _tiny_runs import DIGITS, TINY

HOLD_AFTER_ONE_SHARD = Path(__file__).resolve().parent / "cluster" / "hold_after_one_shard"


@pytest.mark.slurm
def test_torchrun_under_srun_survives_a_stop_signal_and_a_scheduler_requeue(slurm, preemption_reference, tmp_path):
    # Cycle 1: the batch script's trap (scancel --signal=USR1 --batch, what --signal=B:USR1@N sends): SIGTERM to
    # srun, which passes it to torchrun and both workers, and torchrun forwards it again; one checkpoint; the script
    # requeues the job. Cycle 2: `scontrol requeue` (SIGTERM to every process, the batch shell too). Then to the end.
    # Two GPUs asked for: torchrun starts one process per GPU (the test cluster's GPUs are /dev/null; the processes
    # run on the CPU, train.cpu=true).
    run_dir, log, env = tmp_path / "run", tmp_path / "job.log", slurm
    job_id = sbatch(env, "train.sbatch", ["--nodes=1", "--gpus-per-node=2"], [*RUN, f"run.dir={run_dir}"], log)
    wait_for_step(run_dir, 3, log)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True, timeout=60)
    wait_for_requeue(env, job_id, 1, log)
    [(name, first, _)] = stops(log)
    assert name == "SIGTERM" and 3 <= first < 60
    wait_for_step(run_dir, first + 3, log)
    scontrol(env, "requeue", job_id)
    wait_for_requeue(env, job_id, 2, log)
    state = wait_for_end(env, job_id, log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text(log)[-3000:]
    [_, (name, second, seconds)] = stops(log)
    assert name == "SIGTERM" and first < second < 60 and seconds < 30  # KillWait: 30 s
    assert_same_as(run_dir, preemption_reference)
    print(f"job {job_id}: stopped after steps {first} and {second}; {stops(log)}")


@pytest.mark.slurm
def test_a_stop_signal_to_the_steps_of_a_torchrun_job_requeues_it(slurm, preemption_reference, tmp_path):
    # Issue 47: a stop signal that reaches the job's steps themselves (`scancel --signal=TERM JOB`; SIGUSR1 from
    # `--signal=USR1@N` without B:), not the batch script: train.py checkpoints and exits 75, but torchrun turned
    # that into 1 (TERM) or died of SIGUSR1 itself (138), and the job ended FAILED, never requeued. torchrun.sh now
    # carries the 75 past torchrun (the file train.py writes, STOPPED_STATUS_FILE) and torchrun ignores SIGUSR1.
    run_dir, log, env = tmp_path / "run", tmp_path / "job.log", slurm
    job_id = sbatch(env, "train.sbatch", ["--nodes=1", "--gpus-per-node=2"], [*RUN, f"run.dir={run_dir}"], log)
    wait_for_step(run_dir, 3, log)
    subprocess.run(["scancel", "--signal=TERM", job_id], env=env, check=True, timeout=60)
    wait_for_requeue(env, job_id, 1, log)
    [(name, first, _)] = stops(log)
    assert name == "SIGTERM" and 3 <= first < 60 and "srun exited with 75" in text(log), text(log)[-3000:]
    wait_for_step(run_dir, first + 3, log)
    subprocess.run(["scancel", "--signal=USR1", job_id], env=env, check=True, timeout=60)
    wait_for_requeue(env, job_id, 2, log)
    state = wait_for_end(env, job_id, log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text(log)[-3000:]
    [_, (name, second, _)] = stops(log)
    assert name == "SIGUSR1" and first < second < 60, text(log)[-3000:]
    assert_same_as(run_dir, preemption_reference)


@pytest.mark.slurm
def test_a_stop_signal_to_the_steps_of_an_array_task_requeues_it(slurm, tmp_path):
    # The same for train_array.sbatch (torchrun.sh too): the task is requeued, then cancelled (resuming is tested
    # above).
    runs, lines, log = tmp_path / "runs", tmp_path / "runs.txt", tmp_path / "task-0.log"
    lines.write_text("train.seed=1\n")
    array = sbatch(
        slurm, "train_array.sbatch", ["--array=0", "--gpus-per-node=1"], [str(runs), str(lines), *ARRAY_RUN], log
    )
    task = f"{array}_0"
    wait_for_step(runs / "0", 2, log)
    subprocess.run(["scancel", "--signal=TERM", task], env=slurm, check=True, timeout=60)
    wait_until(
        lambda: (state := job(slurm, task))["JobState"] == "PENDING" and state["Restarts"] == "1",
        f"{task} requeued",
        log,
    )
    subprocess.run(["scancel", task], env=slurm, check=True, timeout=60)
    [(name, step, _)] = stops(log)
    assert name == "SIGTERM" and f"job {task} (restart 0): srun exited with 75" in text(log), text(log)[-3000:]


@pytest.mark.slurm
def test_one_task_per_process_stops_at_the_time_limit_warning_and_requeues_itself(
    slurm, preemption_reference, tmp_path
):
    # Two tasks of srun, one per GPU, no launcher. The limit is lowered once the run trains, so that the warning of
    # --signal=B:USR1@180 is due; slurmctld sends SIGUSR1 to the batch script at its next check of limits, up to
    # 30 s later. The tiny run would be over by then: its two processes are paused (SIGSTOP) until the warning
    # has come, then continued; the SIGTERM the trap sends them meanwhile waits for them.
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    options = ["--ntasks-per-node=2", "--gpus-per-node=2", "--time=10", "--signal=B:USR1@180"]
    job_id = sbatch(slurm, "train_tasks.sbatch", options, [*RUN, f"run.dir={run_dir}"], log)
    wait_for_step(run_dir, 2, log)
    trainers = pause(slurm, job_id, f"run.dir={run_dir}")
    elapsed = int(job(slurm, job_id)["RunTime"].split(":")[-2]) + 1  # whole minutes, rounded up
    scontrol(slurm, "update", f"jobid={job_id}", f"TimeLimit={elapsed + 2}")  # the warning is due now
    wait_until(lambda: "SIGUSR1, SIGTERM to its steps" in text(log), "the time-limit warning", log, timeout=60)
    for pid in trainers:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: job(slurm, job_id)["JobState"] == "PENDING", f"job {job_id} requeued", log)
    scontrol(slurm, "update", f"jobid={job_id}", "TimeLimit=10")  # the restart gets the whole time again
    wait_for_requeue(slurm, job_id, 1, log)
    state = wait_for_end(slurm, job_id, log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text(log)[-3000:]
    [(name, step, seconds)] = stops(log)
    assert name == "SIGTERM" and 2 <= step < 60 and seconds < 30
    assert "srun exited with 75" in text(log)  # every task stopped with a checkpoint
    assert_same_as(run_dir, preemption_reference)
    print(f"job {job_id}: stopped after step {step}, {seconds} s after the signal")


@pytest.mark.slurm
def test_sampling_requeued_by_the_scheduler_keeps_its_shards_and_equals_an_uninterrupted_run(slurm, tmp_path):
    import sample

    export = tiny_export(tmp_path / "export")
    arguments = ["--ckpt", str(export), "--num-samples", "50", "--shard-size", "5", "--per-proc-batch-size", "5"]
    arguments += ["--sampler", "ddim", "--steps", "10", "--grid-size", "0", "--cpu"]
    (tmp_path / "reference").mkdir()
    sample.main([*arguments, "--out", str(tmp_path / "reference" / "samples.npz")])
    out, log = tmp_path / "samples" / "samples.npz", tmp_path / "job.log"
    out.parent.mkdir()
    # On its first start each of the job's two processes writes one shard, then waits to be ended
    # (tests/cluster/hold_after_one_shard): the requeue comes after two of the 10 shards, however fast the machine
    # (unheld, the job sampled all 50 in 0.1 s on a loaded 2-core machine)
    env = {**slurm, "PYTHONPATH": os.pathsep.join([str(HOLD_AFTER_ONE_SHARD), str(ROOT)])}
    job_id = sbatch(
        env, "sample.sbatch", ["--ntasks-per-node=2", "--gpus-per-node=2"], [*arguments, "--out", str(out)], log
    )
    shards = out.parent / "samples.npz.shards"
    wait_until(lambda: shards.is_dir() and len(list(shards.glob("shard-*.npz"))) >= 2, "two shards", log)
    scontrol(env, "requeue", job_id)  # SIGTERM to every process: sample.py dies, its shards stay
    wait_for_requeue(env, job_id, 1, log)
    state = wait_for_end(env, job_id, log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text(log)[-3000:]
    assert "resuming, 2 of 10 shards already" in text(log), text(log)[-3000:]
    with np.load(out) as ours, np.load(tmp_path / "reference" / "samples.npz") as theirs:
        assert np.array_equal(ours["arr_0"], theirs["arr_0"]) and np.array_equal(ours["arr_1"], theirs["arr_1"])


# One process per array task (one GPU each), 40 steps of a 64-example batch
ARRAY_RUN = ["--config", str(DIGITS), *TINY, "train.cpu=true", "train.max_steps=40", "log.every=1"]
ARRAY_RUN += ["log.checkpoint_every=20", "log.sample_every=0"]


@pytest.mark.slurm
def test_array_tasks_on_one_node_meet_at_ports_of_their_own_and_one_stops_alone(slurm, tmp_path):
    # Issue 38: two array tasks on one node both met at port 29500 (the second died at start), and a stop signal to
    # the array's last task, whose job id is the array's, stopped and requeued every task. Here both run on node1
    # with one GPU each; task 1's port (15000 + the last four digits of its id, the array's) is held by another
    # program, so that it must take another; then task 1 alone is stopped and requeued (and cancelled: resuming is
    # tested above) while task 0 trains on to the end.
    runs, lines = tmp_path / "runs", tmp_path / "runs.txt"
    lines.write_text("train.mixed_precision=null\ntrain.seed=1\n")  # task 0: the template's precision; task 1: fp32
    logs = [tmp_path / "task-0.log", tmp_path / "task-1.log"]
    options = ["--array=0-1", "--nodelist=node1", "--gpus-per-node=1", "--hold"]
    array = sbatch(slurm, "train_array.sbatch", options, [str(runs), str(lines), *ARRAY_RUN], tmp_path / "task-%a.log")
    tasks, taken = [f"{array}_0", f"{array}_1"], 15000 + int(array) % 10000
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        scontrol(slurm, "release", array)
        for task in (0, 1):
            wait_for_step(runs / str(task), 2, logs[task])
        subprocess.run(["scancel", "--signal=USR1", "--batch", tasks[1]], env=slurm, check=True, timeout=60)
        wait_until(
            lambda: (state := job(slurm, tasks[1]))["JobState"] == "PENDING" and state["Restarts"] == "1",
            f"{tasks[1]} requeued",
            logs[1],
        )
        subprocess.run(["scancel", tasks[1]], env=slurm, check=True, timeout=60)
        end = wait_for_end(slurm, tasks[0], logs[0])
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("COMPLETED", "0:0", "0"), text(logs[0])[-3000:]
    assert stops(logs[0]) == [] and (runs / "0" / "checkpoints" / "step-0000040").is_dir()  # task 0 went on alone
    [(name, step, _)] = stops(logs[1])
    assert name == "SIGTERM" and 2 <= step < 40 and f"job {tasks[1]} (restart 0): srun exited with" in text(logs[1])
    assert f"port {taken} is in use on 127.0.0.1; its processes meet at port" in text(logs[1])
    # one process per GPU; bf16 where the config sets no precision, the config's own (digits: fp32) where it does
    startup = [(runs / str(task) / "startup.txt").read_text() for task in (0, 1)]
    assert all(re.search(r"batch +1 process\(es\) x 64 micro-batch", summary) for summary in startup), startup
    assert re.search(r"precision +bf16,", startup[0]) and re.search(r"precision +fp32,", startup[1]), startup


@pytest.mark.slurm
def test_every_template_asks_for_an_8_gpu_node_as_docs_training_says(slurm):
    # What Slurm records for each batch script as it is (held, then cancelled): the GPUs, CPUs and memory that
    # docs/training.md states, one process per GPU; and the test cluster's node (declared as an 8-GPU node: 128
    # CPUs, 1 TB) takes the job whole.
    page = (ROOT / "docs" / "training.md").read_text()
    gpus, cpus, memory = (
        int(re.search(rf"`--{option}=(\d+)G?`", page)[1]) for option in ("gpus-per-node", "cpus-per-gpu", "mem-per-gpu")
    )
    for script in sorted(SCRIPTS.glob("*.sbatch")):
        held = sbatch(slurm, script.name, ["--hold"], [], Path(os.devnull))
        record = job(slurm, held)
        subprocess.run(["scancel", held], env=slurm, check=True, timeout=60)
        asked = (record["TresPerNode"], record["CpusPerTres"], record["MemPerTres"])
        assert asked == (f"gres:gpu:{gpus}", f"gres:gpu:{cpus}", f"gres:gpu:{memory * 1024}"), script.name
        launcher = "torchrun.sh" in script.read_text()  # one torchrun per node starts one process per GPU
        assert record["NumTasks"] == ("1" if launcher else str(gpus)), script.name
        trial = subprocess.run(
            ["sbatch", "--test-only", str(script)], cwd=ROOT, env=slurm, capture_output=True, text=True
        )
        assert f"using {gpus * cpus} processors on nodes node1 " in trial.stderr, trial.stderr
        if "train.py" in script.read_text():
            assert "export ACCELERATE_MIXED_PRECISION=${ACCELERATE_MIXED_PRECISION:-bf16}" in script.read_text()


@pytest.mark.slurm
def test_latent_extraction_under_srun_without_its_flags_is_refused_in_one_line_before_any_work(slurm, tmp_path):
    # Issue 38: two srun tasks each extracting alone (no GPUs without train.cpu=true; or srun without task.sh) met
    # at the output's lock, and the job ended FAILED once the first had finished. Now each such launch is refused
    # by one line from rank 0 before anything is written; task.sh also refuses tasks that do not match the GPUs.
    from diffusers import AutoencoderKL

    images, latents = make_images(tmp_path / "images", per_class=2), tmp_path / "latents"
    AutoencoderKL(**TINY_VAE).save_pretrained(tmp_path / "vae")
    config = extraction_config(tmp_path, images, latents, tmp_path / "vae")
    extract = f"python -m training.latents --config {config}"
    script, log = tmp_path / "extract.sbatch", tmp_path / "job.log"
    # srun's tasks without task.sh: the check every command makes (train.py, sample.py and training.latents call
    # it once Accelerate is up), here without the command's imports (seconds of CPU each)
    alone = "from commands import *; run_command(lambda argv: check_launched_processes(1, '-m training.latents', ''))"
    script.write_text(f"""#!/bin/bash
source docs/slurm/job.sh
srun docs/slurm/task.sh {extract} train.cpu=false; echo "task.sh without train.cpu=true: $?"
srun python -c "{alone}"; echo "srun alone: $?"
srun --ntasks=1 docs/slurm/task.sh true; echo "one task on two GPUs: $?"
""")
    job_id = sbatch(slurm, script, ["--ntasks-per-node=2", "--gpus-per-node=2"], [], log)
    state = wait_for_end(slurm, job_id, log)
    assert state["JobState"] == "COMPLETED", text(log)[-3000:]
    lines = [line for line in text(log).splitlines() if line.startswith("error: ")]
    assert lines == [
        "error: launched 2 processes but Accelerate sees one: on a machine without GPUs add train.cpu=true",
        "error: srun started 2 tasks that do not know of each other (each would do all the work alone): start them "
        "through docs/slurm/task.sh (`srun docs/slurm/task.sh python -m training.latents ...`), or start one task",
        "error: 1 tasks per node but 2 GPUs per node: ask for one task per GPU (--ntasks-per-node=N --gpus-per-node=N)",
    ], text(log)[-3000:]
    for step in ("task.sh without train.cpu=true", "srun alone", "one task on two GPUs"):
        assert f"{step}: 2" in text(log), text(log)[-3000:]
    assert not latents.exists()  # nothing claimed or written


def test_the_batch_scripts_in_docs_are_the_tested_ones():
    import textwrap

    page = (ROOT / "docs" / "training.md").read_text()
    blocks = [textwrap.dedent(block) for block in re.findall(r"```bash\n(.*?)^ *```", page, re.S | re.M)]
    for script in sorted(SCRIPTS.iterdir()):
        assert script.read_text() in blocks, f"docs/training.md does not show docs/slurm/{script.name} as it is"
