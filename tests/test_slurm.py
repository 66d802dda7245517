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

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from test_faults import TWO_PROCESS, assert_same_checkpoint, logged, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "docs" / "slurm"
HOLD_AFTER_ONE_SHARD = Path(__file__).resolve().parent / "cluster" / "hold_after_one_shard"
SLURM_CONF = os.environ.get("SLURM_CONF", f"{os.environ.get('VCA_SLURM_DIR', '/tmp/vca-slurm')}/slurm.conf")
# 60 steps of a 256-example batch: long enough (about 10 s on 2 cores) for a signal to land in the middle
RUN = [*TWO_PROCESS, "train.max_steps=60", "train.global_batch_size=256", "log.every=1", "log.checkpoint_every=20"]
FINAL = "step-0000060"
SUBMITTED: list[str] = []  # job ids this module submitted
STOPPED = re.compile(r"stopped by (\w+) after step (\d+): checkpoint \S+ written ([\d.]+) s after the signal")


@pytest.fixture(scope="module")
def slurm():
    """The environment of a job: this interpreter's folder on PATH (python, torchrun), the test cluster's config."""
    reason = None
    if shutil.which("sbatch") is None:
        reason = "sbatch not found (tests/cluster/slurm_up.sh installs and starts a single-host Slurm)"
    else:
        env = {**os.environ, "SLURM_CONF": SLURM_CONF}
        answer = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
        if answer.returncode != 0 or not answer.stdout.strip():
            reason = f"no Slurm answers at {SLURM_CONF} (start one with tests/cluster/slurm_up.sh)"
    if reason is not None:
        if os.environ.get("VCA_REQUIRE_SLURM"):
            pytest.fail(reason)
        pytest.skip(reason)
    yield {
        **subprocess_env(),
        "SLURM_CONF": SLURM_CONF,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "MAIN_PORT": str(free_port()),
        "MAIN_HOST": "127.0.0.1",  # the test cluster's node names (node1, node2) are not host names
    }
    if SUBMITTED:  # a failed test leaves no job behind
        subprocess.run(["scancel", *SUBMITTED], env={**os.environ, "SLURM_CONF": SLURM_CONF}, timeout=60)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def sbatch(env: dict, script: str, options: list[str], arguments: list[str], log: Path) -> str:
    """Submit docs/slurm/<script> from the repository's root; returns the job id."""
    done = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", *options, str(SCRIPTS / script), *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    SUBMITTED.append(done.stdout.strip().split(";")[0])
    return SUBMITTED[-1]


def scontrol(env: dict, *arguments: str) -> str:
    done = subprocess.run(["scontrol", *arguments], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def job(env: dict, job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
    fields = scontrol(env, "show", "job", "-o", job_id).split()
    return dict(field.split("=", 1) for field in fields if "=" in field)


def wait_until(condition, what: str, log: Path, timeout: float = 300):
    """Poll `condition` until it returns something true; fail naming `what` and the job's log otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    pytest.fail(f"{what} not seen in {timeout} s; job log:\n{text(log)[-3000:]}")


def pause(env: dict, job_id: str, argument: str) -> list[int]:
    """SIGSTOP the job's Python processes (the two tasks and their data-loader workers) whose command line holds
    `argument`; returns their ids, at least two."""
    listed = scontrol(env, "listpids", job_id).split()[5::5]  # after the header: PID JOBID STEPID LOCALID GLOBALID
    paused = []
    for pid in map(int, listed):
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "python" in Path(arguments[0]).name and argument in arguments:
            os.kill(pid, signal.SIGSTOP)
            paused.append(pid)
    assert len(paused) >= 2, listed
    return paused


def logged_step(run_dir: Path) -> int:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except json.JSONDecodeError:  # a line being written
        return 0


def wait_for_step(run_dir: Path, step: int, log: Path) -> None:
    wait_until(lambda: logged_step(run_dir) >= step, f"step {step} in {run_dir}/metrics.jsonl", log)


def wait_for_requeue(env: dict, job_id: str, restarts: int, log: Path) -> None:
    """Wait until the job is back in the queue for the `restarts`-th time, then let it start at once."""
    wait_until(
        lambda: (state := job(env, job_id))["JobState"] == "PENDING" and int(state["Restarts"]) == restarts,
        f"job {job_id} requeued ({restarts})",
        log,
    )
    # slurmd revokes the credential of the ended run by the second: a restart within that second is refused
    # ("Job credential revoked") and the job fails, which is what the requeue delay of Slurm avoids
    time.sleep(1.5)
    scontrol(env, "update", f"jobid={job_id}", "StartTime=now")


def wait_for_end(env: dict, job_id: str, log: Path) -> dict[str, str]:
    return wait_until(
        lambda: (state := job(env, job_id))["JobState"] in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED") and state,
        f"the end of job {job_id}",
        log,
    )


def text(log: Path) -> str:
    """A job's log (a progress bar cut by a stop may leave half a character)."""
    return log.read_text(errors="replace") if log.exists() else "-"


def stops(log: Path) -> list[tuple[str, int, float]]:
    """(signal, step, seconds from signal to checkpoint) of every stop the job's log reports."""
    return [(name, int(step), float(seconds)) for name, step, seconds in STOPPED.findall(text(log))]


def assert_same_as(run_dir: Path, reference: Path) -> None:
    assert_same_checkpoint(run_dir / "checkpoints" / FINAL, reference / "checkpoints" / FINAL)
    assert logged(run_dir) == logged(reference)


@pytest.mark.slurm
def test_torchrun_under_srun_survives_a_stop_signal_and_a_scheduler_requeue(slurm, preemption_reference, tmp_path):
    # Cycle 1: the batch script's trap (scancel --signal=USR1 --batch, what --signal=B:USR1@N sends): SIGTERM to
    # srun, which passes it to torchrun and both workers, and torchrun forwards it again; one checkpoint; the script
    # requeues the job. Cycle 2: `scontrol requeue` (SIGTERM to every process, the batch shell too). Then to the end.
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    env = {**slurm, "PROCESSES_PER_NODE": "2"}
    job_id = sbatch(env, "train.sbatch", ["--nodes=1", "--cpus-per-task=2"], [*RUN, f"run.dir={run_dir}"], log)
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
def test_one_task_per_process_stops_at_the_time_limit_warning_and_requeues_itself(
    slurm, preemption_reference, tmp_path
):
    # srun --ntasks 2, no launcher. The limit is lowered once the run trains, so that the warning of
    # --signal=B:USR1@180 is due; slurmctld sends SIGUSR1 to the batch script at its next check of limits, up to
    # 30 s later. The tiny run would be over by then: its two processes are paused (SIGSTOP) until the warning
    # has come, then continued; the SIGTERM the trap sends them meanwhile waits for them.
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    options = ["--ntasks=2", "--time=10", "--signal=B:USR1@180"]
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
    from test_sample import tiny_export

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
    job_id = sbatch(env, "sample.sbatch", ["--ntasks=2"], [*arguments, "--out", str(out)], log)
    shards = out.parent / "samples.npz.shards"
    wait_until(lambda: shards.is_dir() and len(list(shards.glob("shard-*.npz"))) >= 2, "two shards", log)
    scontrol(env, "requeue", job_id)  # SIGTERM to every process: sample.py dies, its shards stay
    wait_for_requeue(env, job_id, 1, log)
    state = wait_for_end(env, job_id, log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text(log)[-3000:]
    assert "resuming, 2 of 10 shards already" in text(log), text(log)[-3000:]
    with np.load(out) as ours, np.load(tmp_path / "reference" / "samples.npz") as theirs:
        assert np.array_equal(ours["arr_0"], theirs["arr_0"]) and np.array_equal(ours["arr_1"], theirs["arr_1"])


def test_the_batch_scripts_in_docs_are_the_tested_ones():
    import textwrap

    page = (ROOT / "docs" / "training.md").read_text()
    blocks = [textwrap.dedent(block) for block in re.findall(r"```bash\n(.*?)^ *```", page, re.S | re.M)]
    for script in sorted(SCRIPTS.iterdir()):
        assert script.read_text() in blocks, f"docs/training.md does not show docs/slurm/{script.name} as it is"
