"""Which samples each process takes, batch by batch (compress.data.sampling): every sample once, a resumed
epoch with the same batches, and no last batch of a single image."""


import pytest

from compress.data.datasets import load_data
from compress.data.sampling import EpochBatches, eval_loader, train_loader
from conftest import data_cfg, invoke


def test_a_last_batch_of_one_image_is_merged_into_the_one_before():
    """BatchNorm cannot train on one image; a remainder of one joins the previous batch (every image is still
    seen every epoch), on every rank alike."""
    sampler = EpochBatches(65, 64)
    assert [len(b) for _, b in sampler] == [65] and sampler.batches_per_epoch == 1
    assert sorted(i for _, b in sampler for i in b) == list(range(65))
    ranks = [EpochBatches(66, 32, rank, 2) for rank in (0, 1)]  # 33 per rank: 32 + 1
    assert [[len(b) for _, b in r] for r in ranks] == [[33], [33]]
    assert [len(b) for _, b in EpochBatches(66, 64)] == [64, 2]  # two images train fine: left alone


@pytest.mark.e2e
def test_mobilenet_v2_on_65_digits_trains(tmp_path):
    """mobilenet_v2 trains on 65 digits: no final batch of one image reaches BatchNorm, which cannot train on it
    ('Expected more than 1 value per channel when training')."""
    result = invoke("run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--set", "data.name=digits",
                    "--set", "data.limit=65", "--set", "model.teacher=mobilenet_v2", "--set", "teacher.epochs=1",
                    "--set", "train.progress=false")
    assert result.exit_code == 0, result.output


def test_eval_shards_cover_every_sample_once():
    data = load_data(data_cfg("data.name=digits"), seed=0)
    seen = []
    for rank in range(3):
        for batch in eval_loader(data.val, 16, rank, 3):
            seen.extend(batch.index.tolist())
    assert sorted(seen) == list(range(len(data.val)))


def test_train_loader_resumes_mid_epoch_with_the_same_batches():
    data = load_data(data_cfg("data.name=digits"), seed=0)
    loader = train_loader(data.train, 32, 0, 1, seed=0)
    loader.sampler.set_epoch(2)
    full = [b.index.tolist() for b in loader]
    loader.sampler.set_epoch(2, skip=5)
    assert [b.index.tolist() for b in loader] == full[5:]


@pytest.mark.parametrize("size", [4500, 4501, 1000])
def test_a_global_step_covers_the_same_images_under_any_number_of_processes(size):
    """Each global batch is dealt out over the processes, so step k of an epoch is the same images with 1, 2 or 4
    of them (what lets a run stopped at step k resume there with another count). Only the epoch's last step can
    differ: the padding to a multiple of the processes, and a last batch of one merged into the one before."""
    def steps(world, batch=64):
        ranks = [EpochBatches(size, batch // world, rank, world, seed=3) for rank in range(world)]
        for sampler in ranks:
            sampler.set_epoch(2)
        per_rank = [[indices for _, indices in sampler] for sampler in ranks]
        return [sorted(i for rank in per_rank for i in rank[k]) for k in range(len(per_rank[0]))]

    one = steps(1)
    for world in (2, 4):
        other = steps(world)
        assert len(other) == len(one)
        assert all(a == b for a, b in zip(one[:-1], other[:-1]))  # the last may differ by the padding to `world`
