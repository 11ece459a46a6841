import numpy as np
import pytest
import torch
from PIL import Image

from compress.config import load_config
from compress.data import eval_loader, load_data, train_loader
from compress.errors import InputError


def data_cfg(*overrides):
    return load_config(None, list(overrides)).data


def test_split_is_deterministic_from_the_seed():
    a = load_data(data_cfg("data.name=digits"), seed=0)
    b = load_data(data_cfg("data.name=digits"), seed=0)
    c = load_data(data_cfg("data.name=digits"), seed=1)
    assert torch.equal(a.val.labels, b.val.labels) and torch.equal(a.val.images, b.val.images)
    assert not torch.equal(a.val.images, c.val.images)
    assert len(a.train) + len(a.val) == 1797 and len(a.val) == 180


def test_normalisation_is_computed_on_the_train_split():
    data = load_data(data_cfg("data.name=digits"), seed=0)
    x, _, _ = data.train.batch(range(len(data.train)))
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1.0) < 1e-2
    given = load_data(data_cfg("data.name=digits", "data.mean=[0.5]", "data.std=[0.5]"), seed=0)
    assert given.mean == (0.5,) and given.std == (0.5,)


def test_mnist5k_ships_offline():
    data = load_data(data_cfg(), seed=0)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert len(data.train) == 4500 and len(data.val) == 500


def test_augmentation_depends_only_on_seed_epoch_and_index():
    data = load_data(data_cfg("data.name=digits", "data.augment=true"), seed=0)
    first = data.train.batch([5, 9], epoch=3).x
    other_epoch = data.train.batch([5, 9], epoch=4).x
    assert torch.equal(first, data.train.batch([5, 9], epoch=3).x)
    assert not torch.equal(first, other_epoch)


def test_eval_shards_cover_every_sample_once():
    data = load_data(data_cfg("data.name=digits"), seed=0)
    seen = []
    for rank in range(3):
        for _, _, idx in eval_loader(data.val, 16, rank, 3):
            seen.extend(idx.tolist())
    assert sorted(seen) == list(range(len(data.val)))


def test_train_loader_resumes_mid_epoch_with_the_same_batches():
    data = load_data(data_cfg("data.name=digits"), seed=0)
    loader = train_loader(data.train, 32, 0, 1, seed=0)
    loader.sampler.set_epoch(2)
    full = [idx.tolist() for _, _, idx in loader]
    loader.sampler.set_epoch(2, skip=5)
    assert [idx.tolist() for _, _, idx in loader] == full[5:]


def test_imagefolder_reads_a_class_tree(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.val_fraction=0.25"), seed=0)
    assert data.class_names == ("cat", "dog") and data.input_shape == (3, 16, 16)
    x, y, _ = data.train.batch([0, 1])
    assert x.shape == (2, 3, 16, 16) and set(y.tolist()) <= {0, 1}


def test_imagefolder_unreadable_image_names_the_file(tmp_path):
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / cls / "ok.png")
    (tmp_path / "a" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(InputError, match="cannot read image .*broken.png"):
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=8"), seed=0)


def test_cifar10_without_a_local_copy_says_where_to_put_it(tmp_path):
    with pytest.raises(InputError, match="holds no CIFAR-10 copy"):
        load_data(data_cfg("data.name=cifar10", f"data.root={tmp_path}"), seed=0)
