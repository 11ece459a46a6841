"""Image folders (compress.data.imagefolder): class trees as users copy them, splits, links and link loops,
unlabelled images that are labelled ones, what the summary says a folder's numbers are worth, and the listing
and its digest (each folder listed once per run)."""

import os
import re
import shutil
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from compress.data.datasets import load_data
from compress.errors import InputError
from conftest import HANG, compress_subprocess, data_cfg, image_tree, images, invoke, sized_image_tree


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
    with pytest.raises(InputError, match=r"cannot read image .*broken.png' \(not an image file Pillow recognises\)"):
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=8"), seed=0)
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / "pages" / split / cls).mkdir(parents=True)
            colour = (0, 0, 9 if split == "val" else 0)  # validation images that are not training images
            Image.new("RGB", (8, 8), colour).save(tmp_path / "pages" / split / cls / "ok.png")
    for i in range(10):  # ten scraped web pages saved as .jpg: every one is named
        (tmp_path / "pages" / "train" / "b" / f"page{i}.jpg").write_bytes(b"<html></html>")
    with pytest.raises(InputError) as info:
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'pages'}", "data.image_size=8"), seed=0)
    assert "9 more of the 12 files cannot be read either" in str(info.value) and " more\"" not in str(info.value)
    assert all(f"page{i}.jpg" in str(info.value) for i in range(10))


def test_unreadable_images_of_both_splits_are_named_in_one_error_and_empty_ones_before_any_decoding(tmp_path):
    """A bad file among the training images and another among the validation images: one error names both (one
    fix, one rerun), not the training one first and the validation one on the next run; a 0-byte image is refused
    by the folder scan, which the dry run and the checks before training run too."""
    from compress.data.imagefolder import scan

    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / split / cls).mkdir(parents=True)
            Image.new("RGB", (8, 8), (0, 0, 9 if split == "val" else 0)).save(tmp_path / split / cls / "ok.png")
    (tmp_path / "train" / "a" / "text.jpg").write_bytes(b"a text file")
    (tmp_path / "val" / "b" / "cut.png").write_bytes((tmp_path / "val" / "b" / "ok.png").read_bytes()[:40])
    cfg = data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=8")
    with pytest.raises(InputError) as info:
        load_data(cfg, seed=0)
    assert "text.jpg" in str(info.value) and "cut.png" in str(info.value), str(info.value)
    assert "1 more of the 6 files cannot be read either" in str(info.value)
    (tmp_path / "val" / "a" / "empty.png").write_bytes(b"")
    with pytest.raises(InputError, match=r"1 image file\(s\) under .* are empty \(0 bytes\): '.*empty.png'; fix or "
                                         "remove them"):
        scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=8"))


def test_jpeg_files_under_their_other_names_are_named_with_the_rename_that_reads_them(tmp_path):
    """.jfif (what browsers save) and .jpe are JPEG files: the note says renaming them is enough, not that they
    must be converted. They stay out of the listing (reading them would change the listing of folders holding
    them, and rerun finished stages that never used them)."""
    from compress.data.imagefolder import scan

    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for i, suffix in enumerate((".jpg", ".jfif", ".JPE", ".jpg", ".jpg")):
            Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(tmp_path / cls / f"{i}{suffix}", format="JPEG")
    found = scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=8"))
    assert len(found["train"]) + len(found["val"]) == 6
    assert any("(.jfif, .jpe files are JPEGs: renaming them to .jpg is enough)" in n for n in found["notes"]), \
        found["notes"]


def test_a_held_out_folder_under_a_name_compress_does_not_read_is_named(tmp_path):
    """root/train/ with root/eval/ (or holdout/) beside it: the note names eval/ as not read and the folder names
    that are, instead of holding out 10% of train/ without a word about eval/'s images."""
    from compress.data.imagefolder import scan

    sized_image_tree(tmp_path, ["train"], count=5)
    sized_image_tree(tmp_path, ["eval"], count=3)
    sized_image_tree(tmp_path, ["unlabeled"], classes=("batch0",), count=3)  # data.unlabeled's: no split
    (tmp_path / "models" / "resnet").mkdir(parents=True)  # folders without images in them: no split either
    (tmp_path / "models" / "resnet" / "w.pth").write_bytes(b"x")
    notes = scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16",
                          f"data.unlabeled={tmp_path / 'unlabeled'}"))["notes"]
    unread = [note for note in notes if "beside train/" in note]
    assert len(unread) == 1 and unread[0].startswith("eval/ beside train/ is not read: validation images are taken "
                                                     "from a folder named val/"), notes


def test_imagefolder_with_train_and_val_folders_uses_them_as_the_splits(tmp_path):
    sized_image_tree(tmp_path, ["train"], count=5)
    sized_image_tree(tmp_path, ["val"], count=3)
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16"), seed=0)
    assert (len(data.train), len(data.val)) == (10, 6) and data.class_names == ("cat", "dog")
    assert all(str(tmp_path / "val") in f for f in data.val.files)


def test_folders_as_users_copy_them_mean_what_they_look_like(tmp_path):
    """Train/ and Val/ are splits, not classes (so are Training/ and Testing/, as Kaggle's sets come); valid/,
    validation/ and dev/ are the validation split; macOS's ._0.png
    AppleDouble files, __MACOSX/ and hidden folders such as .thumbnails/ are not images or classes - and eval reads
    a folder the same way, so a folder means one thing."""
    from compress.data.imagefolder import scan
    from compress.deploy.evaluate import labelled_tree

    def found(root):
        got = scan(data_cfg("data.name=imagefolder", f"data.root={root}"))
        return got["classes"], len(got["train"]), len(got["val"]), got["layout"]

    for train, held_out in (("Train", "Val"), ("train", "valid"), ("train", "validation"), ("TRAIN", "Test"),
                            ("Training", "Testing"), ("training", "validation"), ("train", "dev")):
        root = tmp_path / f"{train}-{held_out}"
        sized_image_tree(root, [train], count=5)
        sized_image_tree(root, [held_out], count=3)
        assert found(root) == (["cat", "dog"], 10, 6, f"{train}/ and {held_out}/ folders, used as given")
        assert labelled_tree(str(root), ["cat", "dog"])[0] == str(root / held_out)
    junk = tmp_path / "junk"
    sized_image_tree(junk, [""], count=5)
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
    """data.root one level above a dataset is refused, naming the folder to use, rather than train on "classes"
    that are whole datasets; a val/ folder beside class folders is refused, not taken for a class."""
    sized_image_tree(tmp_path / "photos" / "mine", ["train", "val"])
    sized_image_tree(tmp_path / "photos", ["other"])
    with pytest.raises(InputError, match=r"the class folder '.*mine' holds train/ or val/ folders itself: data.root "
                                         r"is one level too high; set data.root=.*photos/mine$"):
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'photos'}"), seed=0)
    sized_image_tree(tmp_path / "flat", ["", "val"])  # cat/, dog/ and val/ beside them, no train/
    with pytest.raises(InputError, match=r"holds a 'val' folder of class folders beside its class folders; use "
                                         r".*/train/<class>/ with .*/val/<class>/"):
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'flat'}"), seed=0)
    (tmp_path / "download" / "cifar-10-batches-py").mkdir(parents=True)  # torchvision's CIFAR-10, not class folders
    with pytest.raises(InputError, match=r"found 1 class folder; it holds torchvision's CIFAR-10 download, which "
                                         r"data.name=cifar10 reads"):
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'download'}"), seed=0)
    sized_image_tree(tmp_path / "binary", [""], classes=("invalid", "valid"))  # classes that happen to look like splits
    data = load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'binary'}"), seed=0)
    assert data.class_names == ("invalid", "valid")


def test_the_class_count_checks_use_and_a_broken_link_among_the_images(tmp_path):
    """The class count the checks before training use is the loader's: Train/Val are splits and __MACOSX/ is
    skipped, not counted as classes; a dangling image link in the listing is one sentence, not a traceback."""
    from compress.data.datasets import num_classes_of
    from compress.data.imagefolder import listing_digest

    sized_image_tree(tmp_path / "cased", ["Train", "Val"], classes=("a", "b", "c"), count=2)
    sized_image_tree(tmp_path / "flat", [""], classes=("a", "b", "c"), count=2)
    (tmp_path / "flat" / "__MACOSX" / "a").mkdir(parents=True)
    for root in ("cased", "flat"):
        assert num_classes_of(data_cfg("data.name=imagefolder", f"data.root={tmp_path / root}")) == 3
    os.symlink(tmp_path / "gone.png", tmp_path / "flat" / "a" / "zz.png")
    with pytest.raises(InputError, match=r"image '.*zz.png' not found \(a broken link\?\); fix or remove it"):
        listing_digest(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'flat'}"), "root")


def test_a_link_loop_in_a_class_folder_is_not_followed(tmp_path, caplog):
    """A link loop such as cat/up -> .. is not followed, so no class is read again as "cat" (120 images would
    become 4,920)."""
    from compress.data.imagefolder import scan

    root = tmp_path / "data"
    sized_image_tree(root, [""], count=4)
    os.symlink("..", root / "cat" / "up")
    os.symlink(".", root / "dog" / "again")
    (tmp_path / "extra").mkdir()
    shutil.copy(root / "cat" / "0.png", tmp_path / "extra" / "x.png")
    os.symlink(tmp_path / "extra", root / "dog" / "linked")  # a linked folder elsewhere is still read
    got = scan(data_cfg("data.name=imagefolder", f"data.root={root}"))
    assert sorted(label for _, label in got["train"] + got["val"]) == [0] * 4 + [1] * 5
    assert "not following" in caplog.text and "cat/up: it links back to a folder already read" in caplog.text


def test_a_class_missing_from_one_split_is_a_clear_error(tmp_path):
    sized_image_tree(tmp_path, ["train"], classes=("cat", "dog", "owl"))
    sized_image_tree(tmp_path, ["val"])
    with pytest.raises(InputError, match="class 'owl' is in train/ but not in val/"):
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}"), seed=0)


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
    sized_image_tree(tmp_path / "a", ["train", "val"])

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


@pytest.mark.e2e
def test_a_run_lists_its_images_once_however_many_stages_ask_and_the_next_run_lists_them_again(tmp_path,
                                                                                                monkeypatch):
    """Each folder is listed once per run - for the data summary, each stage's decision and each stage's data - and
    afresh by the next run, which sees what changed: at the rate measured on 10,000 files, every extra listing
    costs minutes per run at ImageNet's 1.28 M."""
    from compress.data import imagefolder

    calls = Counter()
    for name in ("_scan", "_listing_digest", "_unlabeled_files"):
        def counted(*args, _real=getattr(imagefolder, name), _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(imagefolder, name, counted)
    image_tree(tmp_path / "img")
    image_tree(tmp_path / "photos", splits=("",), classes=("a", "b"), seed=1)  # other images than img/'s
    args = ["run", "--run-dir", tmp_path / "run", "--stages", "teacher,distill", "--set", "data.name=imagefolder",
            "--set", f"data.root={tmp_path / 'img'}", "--set", f"data.unlabeled={tmp_path / 'photos'}", "--set",
            "data.image_size=8", "--set", "teacher.epochs=1", "--set", "model.teacher=compact_cnn", "--set",
            "model.student=compact_cnn", "--set", "distill.epochs=1", "--set", "distill.baseline=false"]
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    assert calls == {"_scan": 1, "_listing_digest": 2, "_unlabeled_files": 1}  # data.root's and data.unlabeled's
    calls.clear()
    assert "teacher  skip" in invoke(*args, "--dry-run").output
    assert calls == {"_scan": 1, "_listing_digest": 2, "_unlabeled_files": 1}
    shutil.copy(tmp_path / "img" / "train" / "dog" / "0.png", tmp_path / "img" / "train" / "dog" / "new.png")
    again = invoke(*args, "--stages", "teacher")
    assert "teacher: running again: the images in data.root changed" in again.stderr


@pytest.mark.e2e
def test_a_tiny_or_lopsided_folder_runs_end_to_end_and_the_summary_says_what_its_numbers_are_worth(tmp_path):
    """2 classes of 2 images and a class of 1 (2 validation images) run end to end, and the summary names the class
    the split could not hold an image of out for validation and a 40:2 imbalance, so the user knows what the
    numbers are worth."""
    image_tree(tmp_path / "img", splits=("",), count=2)
    image_tree(tmp_path / "img", splits=("",), classes=("owl",), count=1)
    result = invoke("run", "--run-dir", tmp_path / "run", "--set", "data.name=imagefolder", "--set",
                    f"data.root={tmp_path / 'img'}", "--set", "data.image_size=8", "--set", "model.teacher=compact_cnn",
                    "--set", "model.student=compact_cnn", "--set", "teacher.epochs=1", "--set", "distill.epochs=1",
                    "--set", "qat.epochs=1", "--set", "qat.max_accuracy_drop=100", "--set", "qat.float_layers=[]",
                    "--set", "export.latency_repeats=2", "--set", "export.min_int8_speedup=0")
    assert result.exit_code == 0, result.output
    assert "2 validation image(s): each one is 50.0 points of accuracy" in result.stderr
    assert "no validation image of class owl" in result.stderr and os.path.isfile(tmp_path / "run" / "report.md")
    scored = invoke("eval", tmp_path / "run", tmp_path / "img")
    assert scored.exit_code == 0 and "top-1 " in scored.output
    assert "top-5" not in scored.output  # 100 % by definition with 3 classes
    assert f"warning: '{tmp_path / 'img'}' holds the images this model was trained on (data.root of " \
        f"{tmp_path / 'run'}): the accuracy below is not a held-out one" in scored.stderr
    shutil.copytree(tmp_path / "img", tmp_path / "copied")  # the same photos elsewhere: found by their bytes
    copied = invoke("eval", tmp_path / "run", tmp_path / "copied")
    assert copied.exit_code == 0 and "are byte-identical copies of images this model was trained on" in copied.stderr
    image_tree(tmp_path / "new", splits=("",), count=2, seed=7)  # other photos: nothing to say
    new = invoke("eval", tmp_path / "run", tmp_path / "new")
    assert new.exit_code == 0 and "warning" not in new.stderr, new.stderr
    image_tree(tmp_path / "lopsided", splits=("",), classes=("cat",), count=40)
    image_tree(tmp_path / "lopsided", splits=("",), classes=("dog",), count=2)
    plan = invoke("run", "--dry-run", "--run-dir", tmp_path / "run2", "--set", "data.name=imagefolder", "--set",
                  f"data.root={tmp_path / 'lopsided'}", "--set", "data.split_seed=3")
    assert plan.exit_code == 0, plan.output
    assert "the classes are imbalanced (cat: 40 images, dog: 2): always answering cat scores " in plan.output


@pytest.mark.e2e
def test_a_train_folder_without_val_is_split_not_taken_for_a_class(tmp_path):
    """A train/ folder without val/ is split for validation, not taken for the only class."""
    image_tree(tmp_path / "img", splits=("train",), count=10)
    result = invoke("run", "--dry-run", "--run-dir", tmp_path / "run", "--set", "data.name=imagefolder",
                    "--set", f"data.root={tmp_path / 'img'}")
    assert result.exit_code == 0, result.output
    assert "train/ only (no val/ or test/ beside it): 10% of each class held out" in result.output
    assert "2 classes (cat, dog); 18 training / 2 validation images" in result.output


@pytest.mark.e2e
def test_an_empty_class_is_an_error_before_anything_is_written(tmp_path):
    image_tree(tmp_path / "img")
    for f in (tmp_path / "img" / "val" / "dog").iterdir():
        f.unlink()
    result = invoke("run", "--run-dir", tmp_path / "run", "--set", "data.name=imagefolder",
                    "--set", f"data.root={tmp_path / 'img'}")
    assert result.exit_code == 2 and not (tmp_path / "run").exists()
    assert f"class folder '{tmp_path / 'img' / 'val' / 'dog'}' holds no images" in result.stderr
    assert "teacher: running" not in result.stderr


def plan(photos_root, run_dir, *sets):
    args = ["run", "--dry-run", "--run-dir", run_dir, "--stages", "teacher,distill", "--set", "data.name=imagefolder",
            "--set", f"data.root={photos_root}", "--set", "data.image_size=8"]
    return compress_subprocess(*args, *[a for s in sets for a in ("--set", s)], timeout=HANG)


@pytest.mark.e2e
def test_a_self_linked_unlabelled_folder_is_listed_once_in_seconds(photos, tmp_path):
    """Self-links in data.unlabeled (`ln -s . l1; ln -s . l2`) are not followed: the folder is listed once, in
    seconds, each image counted once, where following them walks without end."""
    root, unlabeled = photos
    os.symlink(".", unlabeled / "l1")
    os.symlink(".", unlabeled / "l2")
    os.makedirs(unlabeled / "deeper")
    os.symlink("..", unlabeled / "deeper" / "up")
    proc = plan(root, tmp_path / "run", f"data.unlabeled={unlabeled}")
    assert proc.returncode == 0, proc.stderr
    assert "data.unlabeled: not following" in proc.stderr and "links back to a folder already read" in proc.stderr
    from compress.data.imagefolder import image_files

    assert len(image_files(str(unlabeled))) == 5  # each image once


@pytest.mark.e2e
def test_files_in_the_unlabelled_folder_that_are_not_images_are_counted_in_a_note(photos, tmp_path):
    root, unlabeled = photos
    (unlabeled / "readme.txt").write_text("not an image")
    (unlabeled / "labels.csv").write_text("a,b")
    proc = plan(root, tmp_path / "run", f"data.unlabeled={unlabeled}")
    assert proc.returncode == 0, proc.stderr
    assert "data.unlabeled: 2 file(s) that are not images skipped (.csv, .txt)" in proc.stdout + proc.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["pipe", "link to /dev/zero"])
def test_a_pipe_or_a_device_among_the_images_is_one_sentence_not_a_hang(photos, tmp_path, kind):
    """A FIFO named like an image blocked the images' fingerprint forever (even --dry-run; SIGTERM retried the
    open), and a link to /dev/zero was read until the kernel killed the process: both are refused, naming the file."""
    root, _ = photos
    odd = root / "train" / "cat" / "odd.jpg"
    if kind == "pipe":
        os.mkfifo(odd)
    else:
        os.symlink("/dev/zero", odd)
    proc = plan(root, tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = "a pipe" if kind == "pipe" else "a device through a link"
    assert f"data.root: '{odd}' is {said}, named like an image; reading it would never end - remove it and " \
        "rerun" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_class_folder_linked_to_itself_counts_each_image_once(photos, tmp_path):
    from compress.data.imagefolder import class_tree

    root, _ = photos
    os.symlink(".", root / "train" / "cat" / "again")
    os.makedirs(root / "train" / "dog" / "more")
    os.symlink(os.path.join("..", ".."), root / "train" / "dog" / "more" / "up")  # to train/, which encloses dog/
    names, samples = class_tree(str(root / "train"))
    assert names == ["cat", "dog"] and len(samples) == 24  # 12 each, each once
    os.symlink("..", root / "train" / "all")  # a "class" that would hold every class's images
    with pytest.raises(InputError, match=r"data.root: the class folder '.*/train/all' is a link to '.*/photos', "
                                         r"which holds '.*/train' itself; replace the link"):
        class_tree(str(root / "train"))


@pytest.mark.e2e
def test_unlabelled_images_that_are_labelled_ones_are_refused_naming_the_overlap(photos, tmp_path):
    """data.unlabeled pointing at data.root, its val/ or a folder inside it is refused, naming the overlap: training
    the student on the validation images would inflate the report's gain."""
    root, unlabeled = photos
    run = tmp_path / "run"
    for folder, words in ((root, "is data.root"), (root / "val", "is the labelled folder"),
                          (root / "val" / "cat", "is inside the labelled folder")):
        proc = plan(root, run, f"data.unlabeled={folder}")
        assert proc.returncode == 2 and words in proc.stderr and "point data.unlabeled at images that are not in " \
            "data.root" in proc.stderr, proc.stderr
    copies = tmp_path / "copies"  # byte-identical copies of two validation images, beside new ones
    images(copies, 3, shade=250)
    shutil.copy(root / "val" / "dog" / "001.png", copies / "x.png")
    os.symlink(root / "train" / "cat" / "002.png", copies / "link.png")
    proc = plan(root, run, f"data.unlabeled={copies}")
    assert proc.returncode == 2, proc.stderr
    assert "data.unlabeled: 2 of its images are labelled images of data.root (1 of them validation images)" in \
        proc.stderr and f"'{copies / 'x.png'}' is '{root / 'val' / 'dog' / '001.png'}', a validation image" in \
        proc.stderr
    assert not run.exists()  # refused before anything was written
    assert plan(root, run, f"data.unlabeled={unlabeled}").returncode == 0  # other images are fine
    os.rename(unlabeled, root / "unlabeled")  # beside train/ and val/, in no labelled folder: fine too
    assert plan(root, run, f"data.unlabeled={root / 'unlabeled'}").returncode == 0


def test_photos_with_an_exif_rotation_are_named_before_training_on_them_turned(tmp_path):
    """Pixels are used as stored (as torchvision and timm read them, and as the exported file's rule says), so a
    phone photo whose EXIF tag asks a viewer to rotate it is learnt sideways: the scan says so before training."""
    from compress.data.imagefolder import scan

    image_tree(tmp_path, classes=("cat", "dog"), count=4)
    quiet = scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path}"))
    assert not any("EXIF" in n for n in quiet["notes"])
    turned = tmp_path / "train" / "cat" / "phone.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    Image.new("RGB", (16, 12), (200, 10, 10)).save(turned, exif=exif)
    (note,) = [n for n in scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path}"))["notes"] if "EXIF" in n]
    assert note.startswith(f"1 of 17 images (e.g. {turned}) carry an EXIF orientation") and "mogrify" in note


def test_a_validation_folder_that_holds_the_training_images_is_refused_and_classes_sharing_a_folder_too(tmp_path):
    """val/ that is train/ through a link, holds links to training files, or is a copy of it (cp -r train val)
    would score the model on images it trained on; a few copies are a note; two class folders that are one
    folder through a link would give each image two labels."""
    from compress.data.imagefolder import scan

    def cfg(root):
        return data_cfg("data.name=imagefolder", f"data.root={root}")

    sized_image_tree(tmp_path / "linked", ["train"])
    (tmp_path / "linked" / "val").symlink_to("train")
    with pytest.raises(InputError, match=r"data.root: '.*linked/val' is the training folder '.*linked/train' "
                                         r"\(through a link\): validation accuracy on the training images says"):
        scan(cfg(tmp_path / "linked"))
    sized_image_tree(tmp_path / "files", ["train"])
    for cls in ("cat", "dog"):
        (tmp_path / "files" / "val" / cls).mkdir(parents=True)
        (tmp_path / "files" / "val" / cls / "0.png").symlink_to(tmp_path / "files" / "train" / cls / "3.png")
    with pytest.raises(InputError, match=r"2 of the 2 images in val/ are training images through links \(e.g. "):
        scan(cfg(tmp_path / "files"))
    sized_image_tree(tmp_path / "copied", ["train"])
    shutil.copytree(tmp_path / "copied" / "train", tmp_path / "copied" / "val")
    with pytest.raises(InputError, match=r"12 of 12 images in val/ are byte-identical copies of training images "
                                         r"\(e.g. .*\): val/ holds the training images"):
        scan(cfg(tmp_path / "copied"))
    sized_image_tree(tmp_path / "few", ["train", "val"])
    shutil.copy(tmp_path / "few" / "train" / "dog" / "2.png", tmp_path / "few" / "val" / "dog" / "9.png")
    notes = scan(cfg(tmp_path / "few"))["notes"]
    assert any(n.startswith("1 of 13 images in val/ are byte-identical copies of training images") for n in notes)
    sized_image_tree(tmp_path / "classes", ["train", "val"])
    shutil.rmtree(tmp_path / "classes" / "train" / "dog")
    (tmp_path / "classes" / "train" / "dog").symlink_to("cat")
    with pytest.raises(InputError, match=r"the class folders '.*train/cat' and '.*train/dog' are the same folder"):
        scan(cfg(tmp_path / "classes"))


def test_a_class_spelled_with_other_unicode_characters_in_the_two_splits_is_named_as_such(tmp_path):
    """'café' composed (NFC) in train/ and decomposed (NFD, as macOS writes it) in val/ look identical: the error
    says how they differ instead of 'in train/ but not in val/'."""
    import unicodedata

    from compress.data.imagefolder import scan

    composed, decomposed = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    sized_image_tree(tmp_path, ["train"], classes=(composed, "tea"))
    sized_image_tree(tmp_path, ["val"], classes=(decomposed, "tea"))
    expected = (f"class '{composed}' in train/ and '{decomposed}' in val/ look alike but are written with different "
                "Unicode characters ('caf\\xe9' and 'cafe\\u0301'")
    with pytest.raises(InputError, match=re.escape(expected)):
        scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path}"))


@pytest.mark.skipif(os.name != "posix", reason="file names as bytes")
def test_names_that_are_not_utf8_image_files_read_class_folders_refused(tmp_path):
    """Bytes that are not UTF-8 in a name (Latin-1 names copied from an old disk): an image named so is listed,
    hashed and read like any other (the listing's digest was 'unexpected UnicodeEncodeError', exit 1); a class
    folder named so is refused in a sentence, since class names go into the ONNX metadata and the reports."""
    from compress.data.imagefolder import listing_digest, scan

    root = os.fsencode(tmp_path / "photos")
    for split, count in ((b"train", 6), (b"val", 2)):
        for c, name in enumerate((b"cat", b"dog")):
            folder = os.path.join(root, split, name)
            os.makedirs(folder)
            for i in range(count):
                Image.new("RGB", (20 + i, 20), (60 * c + 5 * i, 40 if split == b"val" else 90, 7 * i)).save(
                    os.fsdecode(os.path.join(folder, b"%d-caf\xe9.png" % i)))
    cfg = data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'photos'}", "data.image_size=16")
    assert len(listing_digest(cfg, "root")) == 64
    data = load_data(cfg, seed=0)
    assert len(data.train) == 12 and data.train.batch([0, 11])[0].shape == (2, 3, 16, 16)
    for split in (b"train", b"val"):
        os.rename(os.path.join(root, split, b"dog"), os.path.join(root, split, b"d\xf6g"))
    with pytest.raises(InputError, match=r"data.root: the class folder '.*d\udcf6g' has a name that is not UTF-8 "
                                         r"text; rename it \(class names are written into the ONNX files"):
        scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'photos'}"))


def test_a_class_of_files_compress_does_not_read_says_how_many_were_skipped_and_which(tmp_path):
    """A class folder of .gif photos (and a .heic one) holds no image compress reads: the error counts the files it
    passed over and names their suffixes, so the fix (convert them) is in the sentence."""
    sized_image_tree(tmp_path, ["train", "val"], count=2)
    for f in (tmp_path / "train" / "dog").iterdir():
        f.unlink()
    for i in range(7):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / "train" / "dog" / f"{i}.gif")
    (tmp_path / "train" / "dog" / "phone.heic").write_bytes(b"\0\0\0\x18ftypheic")
    with pytest.raises(InputError) as e:
        load_data(data_cfg("data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=8"), seed=0)
    assert str(e.value).startswith(f"data.root: class folder '{tmp_path / 'train' / 'dog'}' holds no images (.jpg, "
                                   ".png, ...): 8 file(s) skipped (.gif, .heic); convert them to one of .jpg, .jpeg")


def test_a_held_out_folder_left_unused_beside_the_one_validated_on_is_named(tmp_path):
    """train/ with valid/ and test/: valid/ is the validation split, and the notes (logged before training, shown
    by --dry-run) say test/ is not read."""
    sized_image_tree(tmp_path, ["train", "valid", "test"], count=2)
    result = invoke("run", "--dry-run", "--run-dir", tmp_path / "run", "--set", "data.name=imagefolder",
                    "--set", f"data.root={tmp_path}", "--set", "data.image_size=8")
    assert result.exit_code == 0, result.output
    assert "train/ and valid/ folders, used as given" in result.output
    assert ("data: validation uses valid/; test/ beside it is not used (compress validates on the first of val/, "
            "valid/, validation/, dev/, test/, testing/ there is)" in result.output)


def test_a_flat_folder_holds_out_the_same_share_of_every_class(tmp_path):
    """data.val_fraction of each class, drawn by data.split_seed: 3 classes of 20 images give 2 validation images
    each (a random split of the 60 by seed 0 gave one class none), the two splits disjoint and whole, and
    data.limit's training images a random sample, not the first classes."""
    from compress.data.imagefolder import scan

    image_tree(tmp_path / "img", splits=("",), classes=("cat", "dog", "owl"), count=20)
    for seed in (0, 1):
        found = scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'img'}", f"data.split_seed={seed}"))
        assert Counter(label for _, label in found["val"]) == {0: 2, 1: 2, 2: 2}
        paths = [p for p, _ in found["train"] + found["val"]]
        assert len(paths) == len(set(paths)) == 60
        assert not any("no validation image" in note for note in found["notes"])
    other = scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'img'}", "data.split_seed=0"))["val"]
    assert found["val"] != other  # the seed draws which images
    limited = scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'img'}", "data.limit=12"))["train"]
    assert len(limited) == 12 and len({label for _, label in limited}) > 1
    image_tree(tmp_path / "ones", splits=("",), count=1)  # no class can spare an image for validation
    with pytest.raises(InputError, match=r"^data\.root: no class in '.*ones' has two images, so none can be held out "
                                         r"for validation; add images"):
        scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'ones'}"))


def test_copies_of_images_in_a_folder_split_by_the_seed_are_named_when_they_land_in_validation(tmp_path):
    """`IMG_1 (1).jpg` beside `IMG_1.jpg`, a subfolder copied into its class: the split puts some copies in
    validation, which then counts images trained on; a note says so and names one."""
    from compress.data.imagefolder import scan

    image_tree(tmp_path / "img", splits=("",), count=20)
    cfg = data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'img'}")
    assert not any("byte-identical" in note for note in scan(cfg)["notes"])
    shutil.copytree(tmp_path / "img" / "cat", tmp_path / "dup" / "cat" / "again")
    shutil.copytree(tmp_path / "img" / "dog", tmp_path / "dup" / "dog")
    for f in (tmp_path / "img" / "cat").iterdir():
        shutil.copy(f, tmp_path / "dup" / "cat")
    found = scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'dup'}"))
    note = next(note for note in found["notes"] if "byte-identical" in note)
    assert re.match(r"[0-9]+ of the [0-9]+ validation images split off by data\.split_seed are byte-identical copies "
                    r"of training images \(e\.g\. '.*cat.*' of '.*cat.*'\): the validation accuracy counts them, "
                    r"which reads higher than on new photos; remove the duplicate files$", note), note


def test_advice_for_a_small_or_missing_split_fits_how_the_splits_were_made(tmp_path):
    """Splits used as given (train/ and val/): more images go into val/ - data.val_fraction does nothing there;
    one folder split by the seed: data.val_fraction is the setting."""
    from compress.data.imagefolder import scan

    image_tree(tmp_path / "given", count=3)
    notes = " ".join(scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'given'}"))["notes"])
    assert "each one is 16.7 points of accuracy, so small differences between models are noise; add images to " \
           "val/" in notes and "val_fraction" not in notes
    image_tree(tmp_path / "one", splits=("",), count=5)
    notes = " ".join(scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path / 'one'}"))["notes"])
    assert "add images or raise data.val_fraction" in notes


def test_images_beside_the_class_folders_are_counted_in_a_note_not_dropped_without_a_word(tmp_path):
    """train/loose.png and val/loose.png are in no class: left out, and the listing says how many and where (as
    eval says of its folder)."""
    from compress.data.imagefolder import scan
    from compress.deploy.evaluate import labelled_tree, unread_note

    sized_image_tree(tmp_path, ["train"], count=5)
    sized_image_tree(tmp_path, ["val"], count=3)
    for split in ("train", "val"):
        shutil.copy(tmp_path / split / "cat" / "0.png", tmp_path / split / "loose.png")
    got = scan(data_cfg("data.name=imagefolder", f"data.root={tmp_path}"))
    assert (len(got["train"]), len(got["val"])) == (10, 6)
    for split in ("train", "val"):
        assert (f"1 image(s) directly in '{tmp_path / split}' are in no class folder and are not used; move them into "
                "their class's folder") in got["notes"]
    root, samples = labelled_tree(str(tmp_path), ["cat", "dog"])
    assert len(samples) == 6 and "1 image(s) directly in" in unread_note(root, samples, ["cat", "dog"])
