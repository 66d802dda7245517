"""generation/sample_file.py: the shard plan of a samples file (every index once, lazy for any --num-samples) and the
merge of the shards into one ADM-style .npz (`arr_0` uint8 images, `arr_1` int64 labels), a damaged shard handed to
its repair. sample.py's use of them, end to end: tests/test_sample.py."""

import numpy as np
import pytest

from _sample_shards import write_shards
from atomic_files import save_npz_atomic
from generation.sample_file import DamagedShardError, images_at, merge_shards, plan_shards, shard_reader
from generation.sample_plan import assign_labels


def test_plan_shards_covers_every_index_once():
    shards = plan_shards(1001, 256)
    assert [(s.start, s.stop) for s in shards] == [(0, 256), (256, 512), (512, 768), (768, 1001)]
    covered = np.concatenate([np.arange(s.start, s.stop) for s in shards])
    np.testing.assert_array_equal(covered, np.arange(1001))
    assert len({s.file_name for s in shards}) == len(shards)


def test_the_lazy_shard_plan_is_the_eager_list_of_shards():
    from generation.sample_file import plan_shards

    for num_samples, shard_size in ((1, 1), (5, 7), (1001, 256), (1024, 256)):
        plan = plan_shards(num_samples, shard_size)
        eager = [
            (number, start, min(start + shard_size, num_samples))
            for number, start in enumerate(range(0, num_samples, shard_size))
        ]  # the plan as a list, before
        assert [(shard.number, shard.start, shard.stop) for shard in plan] == eager and len(plan) == len(eager)
        assert [plan.names[number] for number in range(len(plan))] == [shard.file_name for shard in plan]
        assert [plan.names.index(shard.file_name) for shard in plan] == list(range(len(plan)))
        for numbers in (range(len(plan)), range(0, len(plan), 2), range(1, len(plan), 3), range(0)):
            assert plan.samples_in(numbers) == sum(len(plan[number].indices) for number in numbers)
    names = plan_shards(10**9, 256).names  # 3,906,250 shards
    assert names[-1] == "shard-3906249.npz" and names.index("shard-3906249.npz") == 3_906_249
    for other in ("settings.json", "shard-3906250.npz", "shard-0000001.npz", "shard-\uff11.npz", "shard-.npz"):
        with pytest.raises(ValueError):
            names.index(other)


def test_merge_shards_writes_a_standard_npz(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (23, 5, 6, 3), dtype=np.uint8)
    labels = assign_labels(23, 4, "balanced", seed=0)
    shards = plan_shards(23, 5)
    write_shards(tmp_path, images, labels, shards)
    images_of = shard_reader(tmp_path, labels, repair=None)
    merge_shards(shards, images_of, labels, tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as merged:
        assert sorted(merged.files) == ["arr_0", "arr_1"]
        assert merged["arr_0"].dtype == np.uint8 and merged["arr_1"].dtype == np.int64
        np.testing.assert_array_equal(merged["arr_0"], images)
        np.testing.assert_array_equal(merged["arr_1"], labels)
    np.testing.assert_array_equal(images_at(shards, images_of, [0, 7, 22, 3]), images[[0, 7, 22, 3]])
    assert not list(tmp_path.glob(".*tmp*"))


def test_merge_shards_hands_a_shard_of_other_samples_to_repair(tmp_path):
    images = np.arange(8 * 12, dtype=np.uint8).reshape(8, 2, 2, 3)
    labels = assign_labels(8, 4, "balanced", seed=0)
    shards = plan_shards(8, 4)
    write_shards(tmp_path, images, labels, shards)
    wrong = shards[1]
    save_npz_atomic(tmp_path / wrong.file_name, arr_0=images[:4], arr_1=labels[:4], index=np.arange(4))
    (tmp_path / shards[0].file_name).write_bytes(b"PK\x03\x04 cut")  # a damaged file
    repaired = []

    def repair(shard, error):
        assert shard.file_name in str(error)
        repaired.append(shard.number)
        return images[shard.start : shard.stop]

    merge_shards(shards, shard_reader(tmp_path, labels, repair), labels, tmp_path / "out.npz")
    assert repaired == [0, 1]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npz")["arr_0"], images)
    with pytest.raises(DamagedShardError, match=wrong.file_name):
        shard_reader(tmp_path, labels, repair=lambda shard, error: (_ for _ in ()).throw(error))(wrong)
