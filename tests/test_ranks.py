"""Rank and local-rank decisions with mocked launch environments, where a real multi-node launch is too slow:
a job of WORLD_SIZE=4 on two nodes of LOCAL_WORLD_SIZE=2 (ranks 0, 1 on node 0; ranks 2, 3 on node 1, so rank 2
has LOCAL_RANK=0). Once-per-node actions (progress bars) belong to each node's local main process (local rank 0);
once-per-job writes and messages (the latents' manifest, the start-up summary, the trainer's lines) to the global
main process (rank 0) only. tests/test_two_nodes.py runs the real two-node launches."""

from dataclasses import dataclass, field
from pathlib import Path

import accelerate.utils
import pytest
import torch

import training.latents
from _tiny_data import extraction_config, make_images
from training.config import load_config
from training.latents import extract_latents
from training.loop import say

WORLD_SIZE, LOCAL_WORLD_SIZE = 4, 2


@dataclass
class MockedProcess:
    """What Accelerate's PartialState says of one process of the mocked job (RANK=process_index)."""

    process_index: int
    num_processes: int = WORLD_SIZE
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    barrier: object = None  # called at wait_for_everyone: the other processes' work up to the barrier

    @property
    def local_process_index(self) -> int:  # LOCAL_RANK
        return self.process_index % LOCAL_WORLD_SIZE

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def wait_for_everyone(self) -> None:
        if self.barrier is not None:
            barrier, self.barrier = self.barrier, None
            barrier()


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_messages_of_the_job_come_from_the_global_main_process_only(rank, capsys):
    say(MockedProcess(rank), "train.py start-up")  # rank 2 is a local main process: Accelerate's print speaks there
    assert capsys.readouterr().out == ("train.py start-up\n" if rank == 0 else "")


def test_latents_of_four_mocked_processes_on_two_nodes_equal_one_process(
    tmp_path, vae_folder, single_process, monkeypatch
):
    images = make_images(tmp_path / "images", per_class=7)  # 14 images: 4 shards of 4, 4, 4, 2
    alone = extract_latents(
        load_config(extraction_config(tmp_path, images, tmp_path / "alone", vae_folder)), single_process
    )
    config = load_config(extraction_config(tmp_path, images, tmp_path / "four", vae_folder))

    claimed = []  # rank 0's broadcast of the unfinished shards, delivered to the other processes

    def broadcast_object_list(message: list) -> list:
        if claimed:
            message[:] = claimed[0]
        else:
            claimed.append(list(message))
        return message

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast_object_list)
    bars = {}  # rank: whether its progress bar shows
    real_tqdm = training.latents.tqdm
    current = []

    def tqdm(*args, disable: bool, **kwargs):
        bars[current[-1]] = not disable
        return real_tqdm(*args, disable=True, **kwargs)

    monkeypatch.setattr(training.latents, "tqdm", tqdm)
    written_by_others = []

    def other_processes() -> None:  # ranks 1..3 run while rank 0 waits at its first barrier
        for rank in range(1, WORLD_SIZE):
            current.append(rank)
            extract_latents(config, MockedProcess(rank))
        written_by_others.extend(sorted(path.name for path in Path(config.data.latents).iterdir()))
        current.append(0)

    current.append(0)
    four = extract_latents(config, MockedProcess(0, barrier=other_processes))
    shards = [f"shard-{k:05d}.safetensors" for k in range(4)]
    assert "manifest.json" not in written_by_others and set(shards) <= set(written_by_others)
    assert bars == {0: True, 1: False, 2: True, 3: False}  # one bar per node: ranks 0 and 2 have LOCAL_RANK=0
    for name in [*shards, "manifest.json"]:
        assert (four / name).read_bytes() == (alone / name).read_bytes(), name
