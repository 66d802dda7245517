"""Two nodes on one host: two torchrun agents (`--nnodes 2 --node_rank 0|1 --nproc_per_node 1`), so that on the
second node the global rank (1) is not the local rank (0), as on a real two-node job. The run equals one node with
two processes byte for byte (tests/test_slurm.py's reference), also when a stop signal reaches one node's agent
and the run is resumed; FID during training on two nodes is the FID of all samples; sample.py on two nodes
writes one process's .npz, `python -m training.latents` one process's shards.
"""

import json
import shutil
import subprocess
import sys
import time

import pytest

from _launch import ROOT, subprocess_env
from _slurm import (
    RUN,
    assert_same_as,
    free_port,
    job,
    sbatch,
    stops,
    text,
    wait_for_end,
    wait_for_requeue,
    wait_for_step,
)
from _tiny_data import extraction_config, make_images
from _tiny_models import tiny_export
from _tiny_runs import DIGITS, TWO_PROCESSES_20_STEPS, assert_fid_is_that_of_all_samples, fid_monitoring
from training.stop_signals import STOPPED_STATUS

ONCE_PER_JOB = "train.py start-up\n"  # the summary's head: printed by the global main process, not once per node


def two_agents(run_dir, *extra: str, fault: str = "") -> list[subprocess.CompletedProcess]:
    """train.py of RUN under two torchrun agents on this host, one per "node"; their results, node 0's first."""
    script = ROOT / ("tests/_faults.py" if fault else "train.py")
    return two_nodes([str(script), *RUN, f"run.dir={run_dir}", *extra], fault)


def two_nodes(command: list[str], fault: str = "") -> list[subprocess.CompletedProcess]:
    """`command` (a script and its arguments) under two torchrun agents on this host, one per "node"."""
    port = str(free_port())
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node)]
            + ["--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port]
            + command,
            cwd=ROOT,
            env={**subprocess_env(), "FAULT_SIGNAL": fault},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    results = []
    for agent in agents:
        stdout, stderr = agent.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, stderr))
    return results


def test_two_nodes_stopped_through_one_node_and_resumed_equal_one_node_with_two_processes(
    preemption_reference, tmp_path
):
    run_dir = tmp_path / "run"
    # after step 3 the worker of node 1 (global rank 1, local rank 0) sends SIGTERM to its own agent, which
    # forwards it: both nodes stop after the same step
    stopped = two_agents(run_dir, fault="3:1:SIGTERM:parent")
    assert all(agent.returncode != 0 for agent in stopped), [agent.stderr[-2000:] for agent in stopped]
    assert f"exitcode  : {STOPPED_STATUS}" in stopped[0].stderr + stopped[1].stderr
    [checkpoint] = [path for path in (run_dir / "checkpoints").iterdir() if path.name != "step-0000020"]
    assert "stopped by a signal to another process after step" in stopped[0].stdout  # node 0 learnt it from node 1
    assert ONCE_PER_JOB in stopped[0].stdout and ONCE_PER_JOB not in stopped[1].stdout  # global main only
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {path.name for path in checkpoint.iterdir()}
    resumed = two_agents(run_dir, "--resume", "latest")
    assert all(agent.returncode == 0 for agent in resumed), [agent.stderr[-2000:] for agent in resumed]
    assert ONCE_PER_JOB in resumed[0].stdout and ONCE_PER_JOB not in resumed[1].stdout
    assert_same_as(run_dir, preemption_reference)


def test_a_lost_node_ends_the_other_with_one_line_naming_it_and_the_checkpoint_that_stands(tmp_path):
    # After step 3 the process of node 1 is killed (SIGKILL, as when its node dies): node 0's next collective finds
    # the connection reset. It used to end with gloo's traceback ("Connection reset by peer"); now one line.
    run_dir = tmp_path / "run"
    node0, node1 = two_agents(run_dir, "log.checkpoint_every=2", fault="3:1:SIGKILL:self")
    assert "exitcode  : -9" in node1.stderr, node1.stderr[-2000:]
    assert "exitcode  : 2" in node0.stderr, node0.stderr[-3000:]  # a one-line error's status, not a bug's 1
    [line] = [line for line in node0.stderr.replace("\r", "\n").splitlines() if "error:" in line]
    standing = run_dir / "checkpoints" / "step-0000002"
    assert line.startswith("error: lost the connection to the process of this run at 127.0.0.1:"), line
    assert line.endswith(
        f"after step 3: that process or its node has ended (its own log says why); the last checkpoint, {standing}, "
        "is intact: continue with --resume latest"
    ), line
    assert "RuntimeError" not in node0.stderr and "Connection reset" not in node0.stderr  # no gloo traceback


def test_fid_during_training_on_two_nodes_is_the_fid_of_all_samples(bundled_inception, tmp_path):
    # Each node's process draws its half of the FID samples; the global main process logs the FID of all of them
    run_dir = tmp_path / "run"
    command = [
        "train.py",
        "--config",
        str(DIGITS),
        *TWO_PROCESSES_20_STEPS,
        f"run.dir={run_dir}",
        *fid_monitoring(tmp_path),
    ]
    nodes = two_nodes(command)
    assert all(node.returncode == 0 for node in nodes), [node.stderr[-2000:] for node in nodes]
    assert_fid_is_that_of_all_samples(run_dir, bundled_inception)


@pytest.mark.slurm
def test_one_task_on_each_of_two_slurm_nodes_stopped_and_resumed_equals_one_node(slurm, preemption_reference, tmp_path):
    # train_tasks.sbatch on the test cluster's two nodes (two slurmd on this host), one task each: both tasks have
    # local rank 0. Stopped by the batch script's trap, requeued, resumed.
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    options = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1"]
    job_id = sbatch(slurm, "train_tasks.sbatch", options, [*RUN, f"run.dir={run_dir}"], log)
    wait_for_step(run_dir, 3, log)
    assert job(slurm, job_id)["NodeList"] == "node[1-2]"
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=slurm, check=True, timeout=60)
    wait_for_requeue(slurm, job_id, 1, log)
    state = wait_for_end(slurm, job_id, log)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), text(log)[-3000:]
    [(name, step, seconds)] = stops(log)
    assert name == "SIGTERM" and 3 <= step < 60 and seconds < 30 and "srun exited with 75" in text(log)
    assert_same_as(run_dir, preemption_reference)
    print(f"job {job_id}: stopped after step {step}, {seconds} s after the signal")


def test_sampling_on_two_nodes_equals_one_process(tmp_path):
    import numpy as np

    import sample
    from generation.run_layout import TRAINER_STATE

    export = tiny_export(tmp_path / "export")
    arguments = ["--ckpt", str(export), "--num-samples", "12", "--shard-size", "3", "--per-proc-batch-size", "3"]
    arguments += ["--sampler", "ddim", "--steps", "5", "--grid-size", "4", "--cpu"]
    (tmp_path / "one").mkdir()
    sample.main([*arguments, "--out", str(tmp_path / "one" / "samples.npz")])
    (tmp_path / "two").mkdir()
    run_dir = tmp_path / "run"  # the same export as the newest checkpoint of a run: sample.py names the one it uses
    shutil.copytree(export, run_dir / "checkpoints" / "step-0000001" / "export")
    (run_dir / "checkpoints" / "step-0000001" / TRAINER_STATE).write_text("{}")  # written last: a complete checkpoint
    arguments[1] = str(run_dir)
    ran = two_nodes([str(ROOT / "sample.py"), *arguments, "--out", str(tmp_path / "two" / "samples.npz")])
    assert all(agent.returncode == 0 for agent in ran), [agent.stderr[-2000:] for agent in ran]
    using = f"sample.py: --ckpt {run_dir}: using"
    assert using in ran[0].stdout and using not in ran[1].stdout  # said once per job, by the global main process
    summary = json.loads((tmp_path / "two" / "samples.json").read_text())
    assert summary["processes"] == 2 and summary["images_per_process"] == [6, 6]  # both nodes sampled
    assert all("sampling" in agent.stderr for agent in ran)  # a progress bar on each node's local main process
    with np.load(tmp_path / "one" / "samples.npz") as one, np.load(tmp_path / "two" / "samples.npz") as two:
        assert np.array_equal(one["arr_0"], two["arr_0"]) and np.array_equal(one["arr_1"], two["arr_1"])
    assert sorted(path.name for path in (tmp_path / "two").iterdir()) == ["samples.json", "samples.npz", "samples.png"]


def test_latent_extraction_on_two_nodes_equals_one_process(tmp_path, vae_folder, single_process):
    from training.config import load_config
    from training.latents import extract_latents, shard_name

    images = make_images(tmp_path / "images", per_class=7)  # 14 images: 4 shards, 2 on each node
    one = extract_latents(
        load_config(extraction_config(tmp_path, images, tmp_path / "one", vae_folder)), single_process
    )
    two = tmp_path / "two"
    ran = two_nodes(["-m", "training.latents", "--config", str(extraction_config(tmp_path, images, two, vae_folder))])
    assert all(agent.returncode == 0 for agent in ran), [agent.stderr[-2000:] for agent in ran]
    written = [{line.split()[1] for line in agent.stdout.splitlines() if line.startswith("wrote ")} for agent in ran]
    assert written == [{shard_name(0), shard_name(2)}, {shard_name(1), shard_name(3)}]  # by global rank, not local
    assert sorted(path.name for path in two.iterdir()) == sorted(path.name for path in one.iterdir())
    for path in one.iterdir():  # the shards, the manifest and the settings record, byte for byte
        assert (two / path.name).read_bytes() == path.read_bytes(), path.name


# Rank 0 builds the stop-flag group; rank 1, as a node that cannot reach it, never comes.
UNREACHABLE_PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
if rank == 1:
    time.sleep(20)
    sys.exit(0)
import training.stop_signals as stop_signals
stop_signals.CONNECT_TIMEOUT = timedelta(seconds=3)
started = time.monotonic()
try:
    stop_signals.stop_flag_group()
except stop_signals.GroupConnectError as error:
    print(f"{time.monotonic() - started:.1f}", error)
"""


def test_a_node_that_cannot_connect_is_one_line_naming_gloo_socket_ifname():
    port = str(free_port())
    peers = [
        subprocess.Popen(
            [sys.executable, "-c", UNREACHABLE_PEER, str(rank), port],
            cwd=ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    stdout, stderr = peers[0].communicate(timeout=120)
    peers[1].kill()
    peers[1].wait()
    seconds, message = stdout.strip().split(" ", 1)
    assert float(seconds) < 15 and "\n" not in message, (stdout, stderr[-2000:])
    assert message.startswith("the processes of this run cannot connect over gloo within 3 s")
    assert "set GLOO_SOCKET_IFNAME to the network interface" in message


def test_one_nodes_agent_killed_stops_the_run_with_a_checkpoint_and_it_resumes(preemption_reference, tmp_path):
    # Issue 47: one node's torchrun killed (SIGKILL, e.g. by the out-of-memory killer) left its worker training on
    # as an orphan with the other node's to the end, while the other agent waited 300 s at torchrun's exit barrier
    # and ended with 0. The worker now gets SIGTERM when its agent dies (training.stop_signals.
    # stop_with_the_launcher): both ranks stop after the same step with a checkpoint, the other agent ends at once
    # (its worker's 75 is a failure: no exit barrier), and the run resumes to the uninterrupted run's bytes.
    run_dir = tmp_path / "run"
    started = time.monotonic()
    node0, node1 = two_agents(run_dir, fault="3:1:SIGKILL:parent")  # node 1's worker kills its own agent
    assert time.monotonic() - started < 240, "the other agent waited at the exit barrier"
    assert node1.returncode == -9 and node0.returncode == 1, node0.stderr[-2000:]
    assert f"exitcode  : {STOPPED_STATUS}" in node0.stderr, node0.stderr[-2000:]
    assert "stopped by a signal to another process after step" in node0.stdout  # rank 0 learnt it from rank 1
    resumed = two_agents(run_dir, "--resume", "latest")
    assert all(agent.returncode == 0 for agent in resumed), [agent.stderr[-2000:] for agent in resumed]
    assert_same_as(run_dir, preemption_reference)


def test_a_node_started_alone_waits_at_the_rendezvous_for_its_timeout_then_ends(tmp_path):
    # docs/training.md: a node's torchrun started without the others (a node restarted alone) waits for them,
    # silently, for the static rendezvous' timeout: 600 s unless `--rdzv-conf timeout=S` (docs/slurm/torchrun.sh:
    # RENDEZVOUS_TIMEOUT) bounds it; then torchrun ends with 1, naming the timeout. Here 5 s, either node alone.
    for node in (0, 1):
        started = time.monotonic()
        alone = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node)]
            + ["--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
            + ["--rdzv-conf", "timeout=5", "--no-python", "true"],
            cwd=ROOT,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        waited = time.monotonic() - started
        assert alone.returncode == 1 and 5 <= waited < 120, (waited, alone.stderr[-2000:])
        assert ("timed out" in alone.stderr.lower()) and "worker" not in alone.stdout, alone.stderr[-2000:]
