"""Images decoded once (compress.data.pixels): the pixels a run holds are the files' pixels under the rule, kept
in the run's cache and reused, checked against what was recorded when they were written, built by two real
gloo processes exactly as by one, and a set too large for memory says what fixes it."""

import hashlib
import json
import logging
import os

import numpy as np
import pytest
import torch
from PIL import Image

from compress.data import pixels
from compress.data.imageset import FileImages
from compress.deploy import imageio
from compress.errors import InputError
from compress.training.distributed import DistEnv
from conftest import compress_subprocess, invoke


def photos(folder, sizes, kind="JPEG"):
    """Random photos of the given (height, width), as JPEG (or PNG) files; their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(sizes))
    paths = []
    for i, (h, w) in enumerate(sizes):
        path = folder / f"{i:05d}.{kind.lower()}"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path, kind)
        paths.append(str(path))
    return paths


def cached_set(files, place, keep_original=True, size=32, budget=2**30):
    return FileImages(files, (3, size, size), imageio.resize_rule(size, 0.875), keep_original=keep_original,
                      cache_bytes=budget, place=place, role="train" if keep_original else "val")


def test_training_images_are_kept_whole_up_to_four_times_the_crop_size():
    """random_resized_crop's images are kept at their own size up to a shorter side of 4 x image_size (shrunk
    beyond it, never enlarged), and never below the evaluation side."""
    assert pixels.train_side(64, 73) == 256  # the photos recipe: its 224 px photos are kept as they are
    assert pixels.train_side(32, 37) == 128 and pixels.train_side(8, 300) == 300


def test_cached_pixels_are_the_files_decoded_under_the_rule(tmp_path):
    files = photos(tmp_path / "img", [(120, 160), (300, 200), (30, 40), (64, 64)])
    place = pixels.Place(str(tmp_path / "cache"), DistEnv())
    whole = cached_set(files, place)  # random_resized_crop: each image kept whole, shorter side shrunk
    side = pixels.train_side(32, imageio.resize_rule(32, 0.875)["shorter_side"])
    assert side == 128
    shapes = [tuple(whole.source(i).shape) for i in range(4)]
    assert shapes == [(3, 120, 160), (3, 192, 128), (3, 30, 40), (3, 64, 64)]  # shrunk only beyond 128, never enlarged
    for i, path in enumerate(files):
        assert torch.equal(whole.source(i), torch.from_numpy(imageio.load_shrunk(path, 3, side)).permute(2, 0, 1))
    val = cached_set(files, place, keep_original=False)  # evaluation: exactly what predict feeds a deployment
    for i, path in enumerate(files):
        expected = np.array(imageio.load_pixels(path, 3, imageio.resize_rule(32, 0.875)))
        assert torch.equal(val.source(i), torch.from_numpy(expected).permute(2, 0, 1))
    assert sorted(os.listdir(tmp_path / "cache")) == [
        f"train-{pixels.PixelSpec(whole.digest(), 4, 3, whole.held_rule).key}",
        f"val-{pixels.PixelSpec(val.digest(), 4, 3, val.held_rule).key}"]


def test_a_second_load_reuses_the_cache_and_changed_images_get_a_new_one(tmp_path, caplog):
    files = photos(tmp_path / "img", [(50, 70)] * 6)
    place = pixels.Place(str(tmp_path / "cache"), DistEnv())
    with caplog.at_level(logging.INFO, logger="compress.data"):
        first = cached_set(files, place)
        second = cached_set(files, place)
    assert "decoded in" in first.how and "(reused)" in second.how
    assert all(torch.equal(first.source(i), second.source(i)) for i in range(6))
    Image.fromarray(np.zeros((50, 70, 3), dtype=np.uint8)).save(files[2])  # an image replaced
    third = cached_set(files, place)
    assert "decoded in" in third.how and torch.equal(third.source(2), torch.zeros(3, 50, 70, dtype=torch.uint8))
    assert len(os.listdir(tmp_path / "cache")) == 1  # the run's stale cache of this role is gone


def chunk_of(cache_root):
    (folder,) = [os.path.join(cache_root, n) for n in os.listdir(cache_root)]
    return os.path.join(folder, "chunk-000000.safetensors")


def chunk_contents(chunk):
    """(tensors, header metadata) of a chunk file, as a forger would read them."""
    from safetensors.torch import load

    data = open(chunk, "rb").read()
    return load(data), json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]


def test_a_damaged_chunk_is_decoded_again_never_used(tmp_path):
    files = photos(tmp_path / "img", [(50, 70)] * 3)
    place = pixels.Place(str(tmp_path / "cache"), DistEnv())
    good = cached_set(files, place).source(1).clone()
    chunk = chunk_of(tmp_path / "cache")
    data = bytearray(open(chunk, "rb").read())
    data[-5] ^= 0xFF  # one pixel's byte
    open(chunk, "wb").write(bytes(data))
    again = cached_set(files, place)
    assert "1 damaged chunk(s) (chunk-000000.safetensors, ...) decoded again" in again.how
    assert torch.equal(again.source(1), good)


def test_large_images_go_into_smaller_chunks_so_a_build_holds_about_chunk_bytes(tmp_path, monkeypatch):
    """A chunk is decoded, written and checked whole: images large enough that 512 of them would pass
    CHUNK_BYTES go fewer to a chunk (here 8 KB: five 50x70 images kept whole, 10,500 bytes each, one a chunk),
    and read back the same pixels as one chunk of all of them."""
    files = photos(tmp_path / "img", [(50, 70)] * 5)
    whole = cached_set(files, pixels.Place(str(tmp_path / "one"), DistEnv()))
    monkeypatch.setattr(pixels, "CHUNK_BYTES", 8 * 1024)
    small = cached_set(files, pixels.Place(str(tmp_path / "many"), DistEnv()))
    (folder,) = os.listdir(tmp_path / "many")
    chunks = sorted(f for f in os.listdir(tmp_path / "many" / folder) if f.startswith("chunk-"))
    assert len(chunks) == 5 and len(os.listdir(tmp_path / "one" / os.listdir(tmp_path / "one")[0])) == 2
    assert all(torch.equal(small.source(i), whole.source(i)) for i in range(5))


def test_a_file_where_the_cache_folder_goes_is_named_in_one_sentence(tmp_path):
    files = photos(tmp_path / "img", [(50, 70)] * 2)
    place = pixels.Place(str(tmp_path / "cache"), DistEnv())
    cached_set(files, place)
    (folder,) = os.listdir(tmp_path / "cache")
    import shutil
    shutil.rmtree(tmp_path / "cache" / folder)
    (tmp_path / "cache" / folder).write_text("x")
    with pytest.raises(InputError, match="is a file where compress keeps decoded images; remove it"):
        cached_set(files, place)


def test_a_forged_chunk_with_its_own_hashes_rewritten_is_found_by_the_recorded_digest(tmp_path):
    """A chunk rewritten with other pixels and its header's hashes updated to match checks itself fine; the
    digest pixels.json recorded when the chunk was written does not match it. A chunk pixels.json does not
    record at all (the build that wrote it was stopped before recording it) is not trusted either."""
    from compress.training.checkpoint import serialize, tensor_sha256

    files = photos(tmp_path / "img", [(50, 70)] * 3)
    place = pixels.Place(str(tmp_path / "cache"), DistEnv())
    good = cached_set(files, place).source(0).clone()
    chunk = chunk_of(tmp_path / "cache")
    tensors, meta = chunk_contents(chunk)
    tensors["pixels"] = torch.zeros_like(tensors["pixels"])
    meta["sha256"] = json.dumps({k: tensor_sha256(v) for k, v in tensors.items()}, sort_keys=True)
    open(chunk, "wb").write(serialize(tensors, meta))
    again = cached_set(files, place)
    assert "damaged chunk(s)" in again.how and torch.equal(again.source(0), good)
    index = os.path.join(os.path.dirname(chunk), "pixels.json")
    recorded = json.loads(open(index).read())
    recorded["chunks"] = {}
    open(index, "w").write(json.dumps(recorded))
    assert "damaged chunk(s)" in cached_set(files, place).how


def test_every_unreadable_image_is_named_in_one_error_and_their_chunk_is_not_kept(tmp_path):
    files = photos(tmp_path / "img", [(50, 70)] * 4)
    for i in (1, 3):
        open(files[i], "wb").write(b"<html>not an image</html>")
    with pytest.raises(InputError) as e:
        cached_set(files, pixels.Place(str(tmp_path / "cache"), DistEnv()))
    assert f"cannot read image '{files[1]}'" in str(e.value) and f"'{files[3]}'" in str(e.value)
    (index,) = [os.path.join(d, n) for d, _, names in os.walk(tmp_path / "cache") for n in names if n == "pixels.json"]
    recorded = json.loads(open(index).read())
    assert recorded["complete"] is False and recorded["chunks"] == {}  # the chunk with the bad files is not kept


def test_an_image_pillow_cannot_convert_is_refused_in_one_sentence_naming_it(tmp_path):
    """A LAB TIFF decodes, but Pillow cannot convert it to grayscale: training refuses it as an unreadable file
    (decode_chunk collects InputErrors only), not with Pillow's ValueError."""
    files = photos(tmp_path / "img", [(30, 40)] * 2)
    lab = str(tmp_path / "img" / "lab.tif")
    Image.new("LAB", (30, 40)).save(lab)
    _, shapes, bad = pixels.decode_chunk(files + [lab], 1, pixels.keep_aspect(32), threads=2)
    assert len(shapes) == 2 and [path for path, _ in bad] == [lab]
    assert bad[0][1].startswith(f"cannot read image '{lab}' (ValueError: conversion from LAB to RGB not supported)")


def test_a_large_set_outside_a_run_says_what_fixes_decoding_every_batch(tmp_path):
    files = photos(tmp_path / "img", [(200, 300)] * 3)
    held = cached_set(files, None, budget=2**30)
    assert held.pixels is not None and "decoded once into memory" in held.how
    tight = cached_set(files, None, budget=1000)
    assert tight.pixels is None
    assert "3 train images decoded every batch" in tight.how and "raise data.cache_mb to 1" in tight.how
    assert all(torch.equal(tight.source(i), held.source(i)) for i in range(3))  # same pixels either way


def test_a_set_over_the_memory_budget_is_memory_mapped_from_the_cache(tmp_path):
    files = photos(tmp_path / "img", [(50, 70)] * 4)
    place = pixels.Place(str(tmp_path / "cache"), DistEnv())
    mapped = cached_set(files, place, budget=100)
    held = cached_set(files, place)
    assert mapped.pixels.mapped and not held.pixels.mapped and "memory-mapped" in mapped.how
    assert all(torch.equal(mapped.source(i), held.source(i)) for i in range(4))


def test_a_large_jpeg_decodes_at_a_reduced_scale_close_to_the_full_decode(tmp_path):
    (path,) = photos(tmp_path / "img", [(1200, 1600)])
    rng = np.random.default_rng(0)  # smooth content, as photos are: random noise has nothing to keep at 1/8
    smooth = np.kron(rng.integers(0, 256, (12, 16, 3)), np.ones((100, 100, 1))).astype(np.uint8)
    Image.fromarray(smooth).save(path, "JPEG", quality=95)
    fast = imageio.load_shrunk(path, 3, 100)
    with Image.open(path) as im:
        full = np.asarray(im.convert("RGB").resize(fast.shape[1::-1], Image.BILINEAR))
    assert fast.shape == (100, 133, 3)
    assert np.abs(fast.astype(int) - full.astype(int)).mean() < 3.0


def imagefolder(root, per_class, size=(20, 24)):
    for split, n in (("train", per_class), ("val", 4)):
        for c in ("cat", "dog"):
            photos(root / split / c, [size] * n, kind="PNG")


def run_args(root, run, *extra, stages="teacher"):
    return ("run", "--run-dir", run, "--stages", stages, "--set", "data.name=imagefolder", "--set",
            f"data.root={root}", "--set", "data.image_size=16", "--set", "data.augment=random_resized_crop",
            "--set", "teacher.epochs=1", "--set", "teacher.batch_size=64", "--set", "model.teacher=compact_cnn",
            "--set", "train.progress=false", *extra)


@pytest.mark.e2e
def test_two_processes_decode_the_images_once_into_the_same_cache_as_one(tmp_path):
    root = tmp_path / "photos"
    imagefolder(root, per_class=600)  # 1,200 training images: 3 chunks, decoded by two ranks round-robin
    one = compress_subprocess(*run_args(root, tmp_path / "one"))
    two = compress_subprocess(*run_args(root, tmp_path / "two"), "--nproc-per-node", "2")
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]

    def digests(run):
        base = run / "cache" / "pixels"
        return {os.path.join(d, f): hashlib.sha256((base / d / f).read_bytes()).hexdigest()
                for d in os.listdir(base) for f in os.listdir(base / d)}

    assert digests(tmp_path / "one") == digests(tmp_path / "two")
    assert sum(f.startswith("train-") and f.endswith("chunk-000002.safetensors") for f in digests(tmp_path / "two"))
    assert "1,200 train images whole up to shorter side 64" in two.stderr and "decoded in" in two.stderr


@pytest.mark.e2e
def test_a_cache_folder_that_is_another_folder_on_each_node_is_refused_in_one_sentence(tmp_path):
    """Two torchrun launchers ("nodes") in their own working directories, data.cache_dir relative: each node's
    folder is its own disk. Rank 0 writes the chunks into its folder; the other rank, not finding them, is not
    left to fail when it opens one: the run stops with one sentence naming the folder."""
    import socket
    import subprocess
    import sys

    root = tmp_path / "photos"
    imagefolder(root, per_class=8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def node(rank):
        cwd = tmp_path / f"node{rank}"
        cwd.mkdir()
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"compress-{tmp_path.name}", "--log-dir", str(tmp_path / f"elastic{rank}"), "-m", "compress",
             *map(str, run_args(root, tmp_path / "run", "--set", "data.cache_dir=pixels", "--set",
                                "train.threads=1"))],
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"})

    launchers = [node(0), node(1)]
    errors = [p.communicate(timeout=600)[1] for p in launchers]
    assert all(p.returncode != 0 for p in launchers), errors
    said = "\n".join(errors)
    assert "that rank 0 wrote is not there for every process" in said, said[-3000:]
    assert "set data.cache_dir to an absolute path every node sees" in said
    assert "unexpected" not in said and "FileNotFoundError" not in said, said[-3000:]  # (torchrun's own
    # launcher prints a traceback for any failed worker: not ours to check)


@pytest.mark.e2e
def test_every_stage_of_a_run_reuses_the_pixels_the_first_decoded(tmp_path):
    root = tmp_path / "photos"
    imagefolder(root, per_class=20)
    result = invoke(*run_args(root, tmp_path / "run", "--set", "distill.epochs=1", "--set",
                              "model.student=compact_cnn", stages="teacher,distill"))
    assert result.exit_code == 0, result.output
    assert result.stderr.count("decoded in") == 2  # training and validation images, once each
    assert result.stderr.count("(reused)") == 2  # by the distill stage
    assert "decoding every batch" not in result.stderr and "decoded every batch" not in result.stderr


@pytest.mark.e2e
def test_a_first_run_stopped_by_a_bad_image_goes_on_once_the_image_is_fixed(tmp_path):
    """The pixel cache is written while the first stage reads its images, before the run has a manifest: a run
    stopped there (an unreadable image, Ctrl-C) leaves a folder the next run recognises as its own."""
    root, run = tmp_path / "photos", tmp_path / "run"
    imagefolder(root, per_class=8)
    good = (root / "train" / "cat" / "00003.png").read_bytes()
    (root / "train" / "cat" / "00003.png").write_bytes(good[: len(good) // 2])  # a good header: only decoding finds it
    first = invoke(*run_args(root, run))
    assert first.exit_code == 2 and "00003.png" in first.stderr and "truncated" in first.stderr
    assert os.listdir(run) == ["cache"] and not (run / "manifest.json").exists()
    (root / "train" / "cat" / "00003.png").write_bytes(good)
    again = invoke(*run_args(root, run))
    assert again.exit_code == 0, again.stderr
    assert (run / "manifest.json").exists() and len(os.listdir(run / "cache" / "pixels")) == 2  # the stale one pruned


def test_a_folder_with_more_than_a_pixel_cache_is_still_not_a_run(tmp_path):
    run = tmp_path / "run"
    (run / "cache" / "pixels" / "train-0123456789abcdef").mkdir(parents=True)
    invoke_args = ("run", "--run-dir", run, "--set", "data.name=digits", "--dry-run")
    assert invoke(*invoke_args).exit_code == 0
    for other in (run / "cache" / "mine", run / "notes"):
        other.mkdir()
        result = invoke(*invoke_args)
        assert result.exit_code == 2 and "is not empty and is not a compress run" in result.stderr
        other.rmdir()


@pytest.mark.parametrize("keep_original, forged", [
    (False, [[1, 96, 32]]),  # another number of channels
    (False, [[-3, -32, 32]]),  # sides that cannot be
    (False, [[3, 1024, 1]]),  # not the rule's 32 x 32
    (True, [[1, 576, 128]]),
    (True, [[3, -192, -128]]),
    (True, [[3, 256, 129], [3, 126, 128]]),  # a shorter side beyond the 128 kept, the bytes made up by the next
], ids=["eval-channels", "eval-negative", "eval-size", "whole-channels", "whole-negative", "whole-side"])
def test_a_chunk_whose_recorded_shapes_cannot_be_the_rules_is_decoded_again(tmp_path, keep_original, forged):
    """Each image's recorded (C, H, W) is checked against the cache's spec - its channels, positive sides the rule
    gives (the rule's size, or a shorter side of at most the one kept) - so a chunk whose shapes were changed,
    with the bytes they add up to, its header's hashes and pixels.json's digest all made to match, is decoded
    again, never read as pixels of other shapes."""
    from compress.training.checkpoint import serialize, tensor_sha256

    files = photos(tmp_path / "img", [(300, 200)] * 3)
    place = pixels.Place(str(tmp_path / "cache"), DistEnv())
    good = [cached_set(files, place, keep_original).source(i).clone() for i in range(3)]
    chunk = chunk_of(tmp_path / "cache")
    tensors, meta = chunk_contents(chunk)
    tensors["shapes"][:len(forged)] = torch.tensor(forged, dtype=torch.int32)
    assert int(tensors["shapes"].long().prod(1).sum()) == tensors["pixels"].numel()
    meta["sha256"] = json.dumps({k: tensor_sha256(v) for k, v in tensors.items()}, sort_keys=True)
    open(chunk, "wb").write(serialize(tensors, meta))
    index = os.path.join(os.path.dirname(chunk), "pixels.json")
    recorded = json.loads(open(index).read())
    recorded["chunks"]["chunk-000000.safetensors"] = hashlib.sha256(open(chunk, "rb").read()).hexdigest()
    open(index, "w").write(json.dumps(recorded))
    again = cached_set(files, place, keep_original)
    assert "1 damaged chunk(s) (chunk-000000.safetensors, ...) decoded again" in again.how
    assert all(torch.equal(again.source(i), good[i]) for i in range(3))


@pytest.mark.parametrize("header", ["7", "null"])
def test_a_chunk_whose_header_hashes_are_not_a_mapping_is_decoded_again(tmp_path, header):
    """A chunk whose header's 'sha256' is JSON but not a mapping, with the digest pixels.json records made to match
    it, is decoded again (it was an unexpected TypeError)."""
    import hashlib

    from compress.training.checkpoint import serialize

    files = photos(tmp_path / "img", [(50, 70)] * 3)
    place = pixels.Place(str(tmp_path / "cache"), DistEnv())
    good = cached_set(files, place).source(0).clone()
    chunk = chunk_of(tmp_path / "cache")
    tensors, meta = chunk_contents(chunk)
    open(chunk, "wb").write(serialize(tensors, {**meta, "sha256": header}))
    index = os.path.join(os.path.dirname(chunk), "pixels.json")
    recorded = json.loads(open(index).read())
    recorded["chunks"] = {name: hashlib.sha256(open(chunk, "rb").read()).hexdigest() for name in recorded["chunks"]}
    open(index, "w").write(json.dumps(recorded))
    again = cached_set(files, place)
    assert "damaged chunk(s)" in again.how and torch.equal(again.source(0), good)
