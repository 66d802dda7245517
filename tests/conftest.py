"""Fixtures that several test modules share."""

import pytest


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
