"""Jobs on the single-host Slurm of tests/cluster/slurm_up.sh, for the tests marked `slurm`: submitting a batch
script, reading a job's state and log, waiting for a step, a requeue or the end, and the training run they stop
and resume (the `slurm` fixture, the environment of a job, is in conftest.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from _tiny_runs import TWO_PROCESSES_8_STEPS, assert_same_checkpoint, logged

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "docs" / "slurm"

SLURM_CONF = os.environ.get("SLURM_CONF", f"{os.environ.get('VCA_SLURM_DIR', '/tmp/vca-slurm')}/slurm.conf")


# 60 steps of a 256-example batch: long enough (about 10 s on 2 cores) for a signal to land in the middle
RUN = [
    *TWO_PROCESSES_8_STEPS,
    "train.max_steps=60",
    "train.global_batch_size=256",
    "log.every=1",
    "log.checkpoint_every=20",
]


FINAL = "step-0000060"


SUBMITTED: list[str] = []  # job ids submitted by this pytest process (the slurm fixture cancels them)


STOPPED = re.compile(r"stopped by (\w+) after step (\d+): checkpoint \S+ written ([\d.]+) s after the signal")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def sbatch(env: dict, script: str | Path, options: list[str], arguments: list[str], log: Path) -> str:
    """Submit docs/slurm/<script> (or the batch script at a path) from the repository's root; returns the job id."""
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
