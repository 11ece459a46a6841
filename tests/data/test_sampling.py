"""Four defects found by trying bad input as a user might, each with the command that showed it."""

import os
import threading

from compress.data.sampling import EpochBatches
from conftest import compress_subprocess, invoke


def test_a_config_with_a_key_twice_is_refused_with_both_lines(tmp_path):
    config = tmp_path / "twice.yaml"
    config.write_text("teacher:\n  epochs: 3\n  lr: 0.1\n  epochs: 30\n")
    result = invoke("run", "-c", config, "--run-dir", tmp_path / "run")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: config error in {config}: key 'teacher.epochs' appears twice (lines 2 "
                                     "and 4); keep one")
    assert not (tmp_path / "run").exists()


def test_a_last_batch_of_one_image_is_merged_into_the_one_before():
    """BatchNorm cannot train on one image; a remainder of one joins the previous batch (every image is still
    seen every epoch), on every rank alike."""
    sampler = EpochBatches(65, 64)
    assert [len(b) for _, b in sampler] == [65] and sampler.batches_per_epoch == 1
    assert sorted(i for _, b in sampler for i in b) == list(range(65))
    ranks = [EpochBatches(66, 32, rank, 2) for rank in (0, 1)]  # 33 per rank: 32 + 1
    assert [[len(b) for _, b in r] for r in ranks] == [[33], [33]]
    assert [len(b) for _, b in EpochBatches(66, 64)] == [64, 2]  # two images train fine: left alone


def test_mobilenet_v2_on_65_digits_trains(tmp_path):
    """Was: 'unexpected ValueError: Expected more than 1 value per channel when training' (a final batch of one
    image through BatchNorm)."""
    result = invoke("run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--set", "data.name=digits",
                    "--set", "data.limit=65", "--set", "model.teacher=mobilenet_v2", "--set", "teacher.epochs=1",
                    "--set", "train.progress=false")
    assert result.exit_code == 0, result.output


def test_a_manifest_of_deeply_nested_brackets_is_one_clear_sentence(run_copy):
    """Was: 'unexpected RecursionError' from `compress show`."""
    (run_copy / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    result = invoke("show", run_copy)
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: manifest '{run_copy / 'manifest.json'}' is not valid JSON "
                                     "(RecursionError); restore it, or move it away and rerun the stage that wrote it")


def test_a_named_pipe_given_as_an_image_is_refused_without_blocking(finished_run, tmp_path):
    """Was: `compress predict model.onnx some.fifo` blocked forever waiting for a writer."""
    fifo = tmp_path / "image.png"
    os.mkfifo(fifo)
    opened = threading.Event()

    def writer():  # if predict ever opens the pipe for reading, this unblocks it (and the test sees it)
        with open(fifo, "wb") as f:
            opened.set()
            f.write(b"")

    threading.Thread(target=writer, daemon=True).start()
    proc = compress_subprocess("predict", finished_run / "export" / "model.int8.onnx", fifo, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"image '{fifo}' is not a regular file (a pipe, device or socket)" in proc.stderr
    assert not opened.is_set(), "the pipe was opened"
    with open(fifo, "rb"):  # let the writer thread finish
        pass
