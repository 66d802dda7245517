"""How the tests start processes: the environments of the commands they run as subprocesses, and torchrun with two
CPU processes as a module of this interpreter (no PATH lookup), on one host.

Accelerate reads torchrun's environment (RANK, WORLD_SIZE, ...), so the scripts it starts see two processes
exactly as under `torchrun --nproc_per_node 2` on a cluster node; `accelerate launch` would need a config file.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def offline_env() -> dict[str, str]:
    """This environment with one thread per process (on 2 shared cores, more oversubscribe the CPU, and runs of
    one and two processes then use identical kernels), unbuffered output (a killed process's lines are kept) and
    no hub requests."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def subprocess_env() -> dict[str, str]:
    """offline_env(), and the project and tests/ on the path: a script under tests/ (tests/_faults.py) imports both
    wherever it runs."""
    return {**offline_env(), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}


def sample_env() -> dict[str, str]:
    """The environment of sample.py's subprocesses: one thread per process (see offline_env), the project on the
    path."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def launch(command: list[str], fault: str = "", **env: str) -> subprocess.CompletedProcess:
    """`command` from the repository with subprocess_env(), FAULT_SIGNAL=`fault` (tests/_faults.py) and `env`."""
    return subprocess.run(
        command,
        cwd=ROOT,
        env={**subprocess_env(), "FAULT_SIGNAL": fault, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


# The launcher's argv up to the script: a free port on this host (--standalone), two workers.
TORCHRUN_TWO_PROCESSES = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

# The head of a launched script: when the interpreter is about to shut down (the last atexit handler, registered
# first) it prints the gloo threads still running (Linux thread names: pt_gloo_runloop, gloo_tcp_loop). A test
# expects none: a gloo worker running then may abort the finished process (commands.end_processes says how).
# A thread that ends between the listing of /proc/self/task and the read of its name is no longer running: it is
# left out (issue 47: its FileNotFoundError failed a CI run under load), so the line still names every thread
# that runs once the interpreter shuts down. THREAD_NAMES defines the reading alone, for the test of that race.
THREAD_NAMES = """
import os as _os

def _thread_names(tasks):
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended after the listing: not running
            continue
    return names
"""
GLOO_THREADS_AT_EXIT = f"""{THREAD_NAMES}
import atexit as _atexit

def _gloo_threads_at_exit():
    names = _thread_names(_os.listdir("/proc/self/task"))
    line = f"gloo threads at exit: {{sorted(name for name in names if 'gloo' in name)}}\\n"
    _os.write(1, line.encode())  # one write: the lines of two processes sharing a pipe do not interleave

_atexit.register(_gloo_threads_at_exit)
"""
NO_GLOO_THREAD_AT_EXIT = "gloo threads at exit: []"  # the line each process of a clean launch prints


def with_gloo_probe(script: Path, folder: Path) -> Path:
    """A script in `folder` that runs `script` as __main__ (same arguments) after GLOO_THREADS_AT_EXIT."""
    probed = folder / f"probed_{script.name}"
    run = f"import runpy, sys\nsys.path.insert(0, {str(script.parent)!r})\n"  # as `python script` would have it
    probed.write_text(f"{GLOO_THREADS_AT_EXIT}{run}runpy.run_path({str(script)!r}, run_name='__main__')\n")
    return probed
