"""atomic_files/shards.py: a resumable folder of shards (sample.py's, the latents'): the unfinished shards split over
processes as a list would, millions of shards claimed from one listing, a killed writer's temporaries removed, and
the shards of a run with other settings never mixed in."""

import types

import numpy as np
import pytest

from _sample_shards import write_shards
from atomic_files.shards import ShardFolder, ShardFolderError
from generation.sample_file import plan_shards


@pytest.mark.parametrize("count, finished", [(0, []), (1, [0]), (7, []), (7, [0, 3, 6]), (10, [1, 2, 3, 8]), (4, [3])])
def test_pending_shards_split_over_processes_as_the_list_of_unfinished_shards_did(count, finished):
    from atomic_files.shards import PendingShards

    eager = [number for number in range(count) if number not in finished]
    pending = PendingShards(count, finished)
    assert pending == eager and len(pending) == len(eager) and list(reversed(pending)) == eager[::-1]
    for processes in (1, 2, 3, 8):
        for rank in range(processes):
            assert pending[rank::processes] == eager[rank::processes]  # each process's shards, as before


def test_a_folder_of_millions_of_shards_is_claimed_from_one_listing(tmp_path):
    from atomic_files.shards import ShardFolder, ShardNames

    names = ShardNames(10**7, "shard-{:06d}.npz")
    folder = ShardFolder(tmp_path / "out.shards", names, {"seed": 0})
    assert len(folder.claim()) == 10**7
    folder.release()
    for number in (0, 2):
        (tmp_path / "out.shards" / names[number]).write_bytes(b"finished")
    stale, foreign = tmp_path / "out.shards" / f".{names[5]}.tmp-999999999", tmp_path / "out.shards" / "notes.txt"
    stale.write_bytes(b"half a shard")  # left by a killed writer
    foreign.write_text("kept")
    pending = folder.claim()
    assert folder.kept == 2 and len(pending) == 10**7 - 2 and pending[:4] == [1, 3, 4, 5] and pending[-1] == 10**7 - 1
    assert not stale.exists() and foreign.exists()
    folder.release()


@pytest.fixture
def main_process():
    """A stand-in for the Accelerator of a single process (broadcasting is then a no-op)."""
    from accelerate.state import PartialState

    yield types.SimpleNamespace(is_main_process=True, num_processes=1)
    PartialState._reset_state()


def test_shards_of_another_run_are_not_mixed_in(main_process, tmp_path):
    folder_path = tmp_path / "samples.npz.shards"
    shards = plan_shards(8, 4)
    names = [shard.file_name for shard in shards]
    record = {"seed": 0, "num_samples": 8}
    assert ShardFolder(folder_path, names, record).claim(main_process) == [0, 1]
    write_shards(folder_path, np.zeros((8, 2, 2, 3), np.uint8), np.zeros(8, np.int64), shards[:1])
    (folder_path / f".{names[1]}.tmp-999999999").write_bytes(b"half a shard")  # left by a killed writer
    assert ShardFolder(folder_path, names, record).claim(main_process) == [1]
    assert not list(folder_path.glob(".*tmp*"))
    with pytest.raises(ShardFolderError, match="run with seed=0, not 1"):
        ShardFolder(folder_path, names, {**record, "seed": 1}).claim(main_process)
    assert (folder_path / names[0]).exists()
