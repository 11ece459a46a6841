"""Every branch of the run-state decision (compress.run.state.decide), on run directories written by hand:
skip, fresh (new, --force, what changed), resume from a checkpoint (which part, which step), and the cases
that must start over instead; then, through real runs, the images and settings that do and do not run a stage
again."""

import json
import logging
import os
import shutil

import pytest
import torch

from compress.errors import InputError
from compress.fileio import atomic_write_bytes, sha256_file
from compress.run.config import config_slice, load_config, result_hash, section_hash
from compress.run.rundir import RunDir
from compress.run.state import checkpoint_rel, decide, missing_upstream, stage_states
from compress.training.checkpoint import read_safetensors, save_training_state, serialize
from conftest import HANG, compress_subprocess, fault_subprocess, file_bytes, image_tree, invoke
from stages import STAGES

TEACHER = "teacher/model.safetensors"


def cfg(*overrides):
    return load_config(None, ["data.name=digits", *overrides])


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path / "run")


def write(run, rel, data=b"weights"):
    atomic_write_bytes(run.path(rel), data)
    return sha256_file(run.path(rel))


def complete(run, stage, config, outputs=(), inputs=None):
    spec = STAGES[stage]
    sums = {rel: write(run, rel, f"{stage} {rel}".encode()) for rel in outputs}
    run.update_stage(stage, status="complete", config_hash=section_hash(config, spec.CONFIG_KEYS),
                     config=config_slice(config, spec.CONFIG_KEYS),
                     inputs=inputs or {}, outputs=sums, metrics={})
    return sums


def checkpoint(run, stage, config, epoch, step, part="", world=1, inputs=None, config_hash=None, result=None):
    model = torch.nn.Linear(2, 2)
    state = {"stage": stage, "config_hash": config_hash or section_hash(config, STAGES[stage].CONFIG_KEYS),
             **({"result_hash": result_hash(config, STAGES[stage].CONFIG_KEYS, False)} if result else {}),
             "inputs": inputs or {}, "epoch": epoch, "step": step, "history": [{"val_acc": 1.0}] * epoch,
             "running": None, "world_size": world, "extra": {"float_layers": ["stem.0"]}}
    save_training_state(run.path(checkpoint_rel(stage, part)), {"model": model},
                        torch.optim.SGD(model.parameters(), lr=0.1), state)


def test_a_new_stage_runs_fresh(run):
    state = decide(run, cfg(), STAGES["teacher"], False, STAGES, 1)
    assert (state.action, state.reason, state.headline, state.resume) == ("fresh", "not run yet", "running", {})


def test_force_runs_a_complete_stage_again(run):
    complete(run, "teacher", cfg(), [TEACHER])
    state = decide(run, cfg(), STAGES["teacher"], True, STAGES, 1)
    assert (state.reason, state.headline) == ("--force", "running (--force)")


def test_a_complete_stage_with_the_same_config_and_files_is_skipped(run):
    complete(run, "teacher", cfg(), [TEACHER])
    assert decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).action == "skip"


def test_a_changed_key_the_stage_depends_on_reruns_it_and_names_the_key(run):
    complete(run, "teacher", cfg(), [TEACHER])
    state = decide(run, cfg("teacher.epochs=5"), STAGES["teacher"], False, STAGES, 1)
    assert state.action == "fresh" and state.reason == "config changed (teacher.epochs)"
    assert state.headline == "running again: config changed (teacher.epochs)"
    # a key of another stage does not touch this one
    assert decide(run, cfg("distill.epochs=5"), STAGES["teacher"], False, STAGES, 1).action == "skip"


def test_a_missing_or_modified_output_reruns_the_stage(run):
    complete(run, "teacher", cfg(), [TEACHER])
    write(run, TEACHER, b"edited")
    assert decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).reason.endswith(f"its output {TEACHER} was modified")
    os.unlink(run.path(TEACHER))
    assert decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).reason.endswith(f"its output {TEACHER} is missing")


def test_a_stage_whose_input_is_not_there_says_which_stage_to_run(run):
    with pytest.raises(InputError, match="run the teacher stage first: teacher/model.safetensors is not in"):
        decide(run, cfg(), STAGES["distill"], False, STAGES, 1)
    complete(run, "teacher", cfg(), [TEACHER])
    run.update_stage("teacher", status="interrupted")  # rerun and stopped: its old file is there, not current
    assert os.path.isfile(run.path(TEACHER))
    with pytest.raises(InputError, match=r"run the teacher stage first: its last run in .* was interrupted \(add "
                                         r"teacher to --stages to finish it"):
        decide(run, cfg(), STAGES["distill"], False, STAGES, 1)
    assert missing_upstream(run, cfg(), ["distill"], STAGES).startswith(
        "distill: run the teacher stage first: its last run in")
    assert missing_upstream(run, cfg(), ["teacher", "distill"], STAGES) == ""  # the run finishes it first


def test_a_new_input_reruns_the_stage_that_read_the_old_one(run):
    sums = complete(run, "teacher", cfg(), [TEACHER])
    complete(run, "distill", cfg(), ["distill/model.safetensors"], inputs=sums)
    assert decide(run, cfg(), STAGES["distill"], False, STAGES, 1).action == "skip"
    complete(run, "teacher", cfg(), [TEACHER])  # retrained: other bytes
    write(run, TEACHER, b"a retrained teacher")
    run.update_stage("teacher", outputs={TEACHER: sha256_file(run.path(TEACHER))})
    state = decide(run, cfg(), STAGES["distill"], False, STAGES, 1)
    assert state.reason == f"its input {TEACHER} changed"


def test_a_hand_modified_upstream_file_is_not_skipped_over(run):
    """A stage's input replaced by hand (distill/model.safetensors) is not skipped over: the decision reads the file,
    not only the checksum the distill stage recorded, so the stage runs, and loading the file refuses it
    (test_bad_inputs: "was modified after it was written", exit 2, nothing written)."""
    sums = complete(run, "teacher", cfg(), [TEACHER])
    complete(run, "distill", cfg(), ["distill/model.safetensors"], inputs=sums)
    assert decide(run, cfg(), STAGES["distill"], False, STAGES, 1).action == "skip"
    write(run, TEACHER, b"someone else's teacher")
    state = decide(run, cfg(), STAGES["distill"], False, STAGES, 1)
    assert (state.action, state.reason) == ("fresh", f"its input {TEACHER} was modified after it was written")
    assert state.inputs[TEACHER] == sums[TEACHER]  # the recorded checksum: what the stage's load verifies


def test_a_hand_modified_optional_input_is_left_out_once_not_rerun_every_time(run, caplog):
    """Export reads the teacher only for the report's comparison row. A teacher file modified by hand makes export
    run once without it, and export is up to date after that rather than rerun on every call; once the teacher
    stage rewrites the file, export reads it again."""
    c = cfg()
    teacher = complete(run, "teacher", c, [TEACHER])
    models = complete(run, "distill", c, [STAGES["distill"].OUTPUTS["model"]], inputs=teacher)
    models |= complete(run, "qat", c, [STAGES["qat"].OUTPUTS["model"]], inputs=models)
    export = decide(run, c, STAGES["export"], False, STAGES, 1)
    assert TEACHER in export.inputs
    complete(run, "export", c, ["export/export.json"], inputs=export.inputs)
    assert decide(run, c, STAGES["export"], False, STAGES, 1).action == "skip"
    write(run, TEACHER, b"someone else's teacher")
    with caplog.at_level(logging.WARNING):
        state = decide(run, c, STAGES["export"], False, STAGES, 1)
    assert (state.action, state.reason) == (
        "fresh", f"its optional input {TEACHER} is not usable now (modified, gone, or its stage unfinished)")
    assert TEACHER not in state.inputs and "teacher:model" not in state.sources
    assert f"export: leaving out {TEACHER} (optional): it was modified after the teacher stage wrote it" in caplog.text
    complete(run, "export", c, ["export/export.json"], inputs=state.inputs)  # ran without it
    assert decide(run, c, STAGES["export"], False, STAGES, 1).action == "skip"
    run.update_stage("teacher", outputs={TEACHER: sha256_file(run.path(TEACHER))})  # the teacher stage rewrote it
    state = decide(run, c, STAGES["export"], False, STAGES, 1)
    assert (state.action, state.reason) == ("fresh", f"its input {TEACHER} changed")


def test_the_images_are_an_input_and_a_stage_recorded_without_them_is_not_rerun_for_it(run, tmp_path):
    """Image folders: what data.root lists is an input (test_first_hour runs it through the CLI). A stage that an
    older version recorded without that input stays up to date: upgrading must not retrain a finished teacher."""
    from PIL import Image

    for cls in ("cat", "dog"):
        (tmp_path / "img" / cls).mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / "img" / cls / f"{i}.png")
    c = cfg("data.name=imagefolder", f"data.root={tmp_path / 'img'}")
    state = decide(run, c, STAGES["teacher"], False, STAGES, 1)
    assert list(state.inputs) == ["external:images in data.root", "external:image bytes in data.root"]
    complete(run, "teacher", c, [TEACHER], inputs=state.inputs)
    assert decide(run, c, STAGES["teacher"], False, STAGES, 1).action == "skip"
    edited = tmp_path / "img" / "cat" / "2.png"
    size = edited.stat().st_size
    Image.new("RGB", (4, 4), (7, 0, 0)).save(edited)  # edited in place: another image, the same file size
    assert edited.stat().st_size == size
    assert decide(run, c, STAGES["teacher"], False, STAGES, 1).reason == (
        "the image bytes in data.root changed (an image edited in place)")
    os.rename(tmp_path / "img" / "dog" / "4.png", tmp_path / "img" / "cat" / "9.png")  # moved to another class
    assert decide(run, c, STAGES["teacher"], False, STAGES, 1).reason == (
        "the images in data.root changed (images added, removed, renamed, replaced, or moved between classes or "
        "between training and validation)")
    listing = decide(run, c, STAGES["teacher"], False, STAGES, 1).inputs["external:images in data.root"]
    for recorded in ({}, {"external:images in data.root": listing}):  # as versions before this one recorded it
        complete(run, "teacher", c, [TEACHER], inputs=recorded)
        assert decide(run, c, STAGES["teacher"], False, STAGES, 1).action == "skip"


def test_editing_the_code_of_your_model_runs_its_stages_again(run, tmp_path, monkeypatch):
    """Editing the code of a user model reruns its stages, whether or not the edit changes the shapes, rather than
    skip the teacher and let distill fail with a bare size mismatch."""
    source = ("import torch.nn as nn\n\ndef net(num_classes):\n"
              "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    (tmp_path / "edited_models.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    c = cfg("model.teacher=edited_models:net")
    state = decide(run, c, STAGES["teacher"], False, STAGES, 1)
    assert "external:code of model.teacher" in state.inputs
    complete(run, "teacher", c, [TEACHER], inputs=state.inputs)
    assert decide(run, c, STAGES["teacher"], False, STAGES, 1).action == "skip"
    (tmp_path / "edited_models.py").write_text(source.replace("nn.Flatten(), ", "nn.Flatten(), nn.Dropout(0.1), "))
    assert decide(run, c, STAGES["teacher"], False, STAGES, 1).reason == "the code of model.teacher changed"
    assert "external:code of model.teacher" not in decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).inputs


def test_a_checkpoint_written_before_digests_were_followed_still_resumes(run, tmp_path):
    """A resume checkpoint recorded without an image digest among its inputs (as versions before digests were
    followed wrote them) resumes the interrupted teacher, not start it over ("other inputs (images ...) changed")."""
    from PIL import Image

    for cls in ("cat", "dog"):
        (tmp_path / "img" / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / "img" / cls / f"{i}.png")
    c = cfg("data.name=imagefolder", f"data.root={tmp_path / 'img'}")
    run.update_stage("teacher", status="interrupted")
    checkpoint(run, "teacher", c, epoch=1, step=2, inputs={})
    state = decide(run, c, STAGES["teacher"], False, STAGES, 1)
    assert (state.action, state.resume[""].epoch) == ("resume", 1), state.reason
    checkpoint(run, "teacher", c, epoch=1, step=2, inputs={"external:images in data.root": "0" * 64})
    assert decide(run, c, STAGES["teacher"], False, STAGES, 1).reason.endswith(
        "other inputs (images in data.root changed since); starting over")


def test_a_checkpoint_written_before_an_input_changed_names_the_input(run):
    sums = complete(run, "teacher", cfg(), [TEACHER])
    run.update_stage("distill", status="interrupted")
    checkpoint(run, "distill", cfg(), epoch=1, step=3, inputs=sums)
    complete(run, "teacher", cfg(), [TEACHER])
    write(run, TEACHER, b"a retrained teacher")
    run.update_stage("teacher", outputs={TEACHER: sha256_file(run.path(TEACHER))})
    assert decide(run, cfg(), STAGES["distill"], False, STAGES, 1).reason == (
        "its resume checkpoint (distill/last/checkpoint.safetensors) was written by an earlier run with other inputs "
        f"({TEACHER} changed since); starting over")


def test_a_stage_that_failed_before_its_first_checkpoint_says_so_when_it_runs_again(run):
    run.update_stage("teacher", status="failed", message="teacher: the loss became nan at epoch 1, step 3; lower it")
    state = decide(run, cfg(), STAGES["teacher"], False, STAGES, 1)
    assert state.action == "fresh" and state.headline == (
        "running again: the last run failed (teacher: the loss became nan at epoch 1, step 3) before its first "
        "checkpoint")
    run.update_stage("teacher", status="interrupted")
    assert decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).reason == (
        "the last run was interrupted before its first checkpoint; starting over")
    sums = complete(run, "teacher", cfg(), [TEACHER])  # a stage that writes no checkpoints: no word of them
    complete(run, "distill", cfg(), ["distill/model.safetensors"], inputs=sums)
    complete(run, "qat", cfg(), ["qat/qat.safetensors"], inputs={})
    run.update_stage("export", status="failed", message="export: 1 check(s) failed - int8_parity: low; files kept")
    assert decide(run, cfg(), STAGES["export"], False, STAGES, 1).headline == (
        "running again: the last run failed (export: 1 check(s) failed - int8_parity: low)")


def test_an_interrupted_stage_resumes_from_the_step_its_checkpoint_names(run):
    run.update_stage("teacher", status="interrupted")
    checkpoint(run, "teacher", cfg(), epoch=1, step=7)
    state = decide(run, cfg(), STAGES["teacher"], False, STAGES, 1)
    assert state.action == "resume" and state.reason == "resuming the interrupted run at epoch 2, step 7"
    point = state.resume_of("")
    assert (point.path, point.epoch, point.step) == (checkpoint_rel("teacher"), 1, 7)
    assert point.extra["float_layers"] == ["stem.0"]  # what the stage kept with it comes back with the state


def test_a_checkpoint_of_another_config_or_a_damaged_one_starts_over(run):
    run.update_stage("teacher", status="interrupted")
    checkpoint(run, "teacher", cfg(), epoch=1, step=7, config_hash="0123456789abcdef")
    assert decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).reason == (
        "its resume checkpoint (teacher/last/checkpoint.safetensors) was written by an earlier run with another "
        "config; starting over")
    checkpoint(run, "teacher", cfg(), epoch=9, step=0)  # beyond the configured 4 epochs: a longer run's, not damaged
    reason = decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).reason  # a longer run's, not "damaged"
    assert reason == ("the resume checkpoint is of an earlier run that got to epoch 9, past the 4 epochs asked now; "
                      "starting over")
    run.update_stage("teacher", config_hash=section_hash(cfg("teacher.epochs=2"), STAGES["teacher"].CONFIG_KEYS))
    assert stage_states(run, STAGES)["teacher"] == (  # the interrupted run asked for other settings
        "interrupted", "its resume checkpoint is of an earlier run with another config; will start over")
    checkpoint(run, "teacher", cfg(), epoch=1, step=-1)
    reason = decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).reason
    assert reason.startswith("the resume checkpoint is damaged ('step' is -1") and "starting over" in reason
    write(run, checkpoint_rel("teacher"), b"\x00garbage")
    reason = decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).reason
    assert reason.startswith("the resume checkpoint is unreadable") and reason.endswith("starting over")
    assert "delete it" not in reason and "--force" not in reason  # what it advised happens anyway


def test_a_checkpoint_of_another_world_size_resumes_where_it_stopped_and_says_it_is_not_bit_identical(run):
    """Step 7 covers the same images under any split of the global batch (tests/data/test_sampling.py): the run
    goes on from there - not from the epoch's start with the weights of step 7, which trained those steps twice -
    and the reason says the result is not bit-identical; at an epoch's end too."""
    run.update_stage("teacher", status="interrupted")
    for step in (7, 0):
        checkpoint(run, "teacher", cfg(), epoch=1, step=step, world=2)
        state = decide(run, cfg(), STAGES["teacher"], False, STAGES, 1)
        assert state.resume_of("").step == step
        assert ("(written by 2 processes, resumed by 1: the same images in the same order, the result not "
                "bit-identical to a run that was never stopped)") in state.reason, state.reason
        same = decide(run, cfg(), STAGES["teacher"], False, STAGES, 2)
        assert same.resume_of("").step == step and "bit-identical" not in same.reason


def test_a_resume_checkpoint_of_another_config_names_the_keys_it_starts_over_for(run):
    """The checkpoint holds its config's hash; the manifest entry of the run that wrote it holds the config: the
    reason names what changed (teacher.lr), as it does for a finished stage, not only 'another config'."""
    keys = STAGES["teacher"].CONFIG_KEYS
    run.update_stage("teacher", status="interrupted", config_hash=section_hash(cfg(), keys),
                     config=config_slice(cfg(), keys))
    checkpoint(run, "teacher", cfg(), epoch=1, step=3)
    reason = decide(run, cfg("teacher.lr=0.5"), STAGES["teacher"], False, STAGES, 1).reason
    assert reason == ("its resume checkpoint (teacher/last/checkpoint.safetensors) was written by an earlier run with "
                      "another config (teacher.lr); starting over"), reason


def test_the_baseline_part_resumes_only_from_a_checkpoint_of_the_same_run(run):
    sums = complete(run, "teacher", cfg(), [TEACHER])
    run.update_stage("distill", status="interrupted")
    checkpoint(run, "distill", cfg(), epoch=8, step=0, inputs=sums)
    checkpoint(run, "distill", cfg(), epoch=3, step=2, part="baseline", inputs=sums)
    state = decide(run, cfg(), STAGES["distill"], False, STAGES, 1)
    assert state.reason == "resuming the interrupted run after its last epoch; its baseline part at epoch 4, step 2"
    assert state.resume_of("baseline").epoch == 3 and state.resume_of("baseline").step == 2
    checkpoint(run, "distill", cfg(), epoch=3, step=2, part="baseline", inputs=sums, config_hash="f" * 16)
    assert decide(run, cfg(), STAGES["distill"], False, STAGES, 1).resume_of("baseline") is None


def test_parts_resumed_under_a_setting_that_cannot_change_the_result_still_resume_together(run):
    """The main part stamped without a result hash (as older versions did), or before data.cache_mb changed, and
    its baseline resumed and re-stamped since: both parts resume - the baseline's stamp need not be the main
    part's to the byte, only the same as it counts."""
    sums = complete(run, "teacher", cfg(), [TEACHER])
    run.update_stage("distill", status="interrupted")
    checkpoint(run, "distill", cfg(), epoch=8, step=0, inputs=sums)  # as the previous version wrote it
    checkpoint(run, "distill", cfg(), epoch=5, step=1, part="baseline", inputs=sums, result=True)  # and this one
    state = decide(run, cfg(), STAGES["distill"], False, STAGES, 1)
    assert state.action == "resume" and state.resume_of("baseline").epoch == 5
    checkpoint(run, "distill", cfg(), epoch=8, step=0, inputs=sums, result=True)
    checkpoint(run, "distill", cfg("data.cache_mb=0"), epoch=5, step=1, part="baseline", inputs=sums, result=True)
    state = decide(run, cfg("data.cache_mb=0"), STAGES["distill"], False, STAGES, 1)
    assert state.action == "resume" and state.resume_of("baseline").epoch == 5
    checkpoint(run, "distill", cfg("data.cache_mb=0", "distill.lr=0.3"), epoch=5, step=1, part="baseline",
               inputs=sums, result=True)  # a change that does matter
    assert decide(run, cfg("data.cache_mb=0"), STAGES["distill"], False, STAGES, 1).resume_of("baseline") is None


def test_a_failed_stage_is_retried_from_its_checkpoint_and_says_it_failed(run):
    run.update_stage("teacher", status="failed", message="teacher: the loss became nan at epoch 2; lower it")
    checkpoint(run, "teacher", cfg(), epoch=1, step=0)
    reason = decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).reason
    assert reason.startswith("the last run failed (teacher: the loss became nan at epoch 2)")


def test_an_optional_input_that_is_absent_is_left_out(run):
    complete(run, "distill", cfg(), ["distill/model.safetensors"])
    complete(run, "qat", cfg(), ["qat/qat.safetensors"])
    state = decide(run, cfg(), STAGES["export"], False, STAGES, 1)
    assert set(state.sources) == {"distill:model", "qat:model"}  # no teacher: its latency row is optional


def test_reading_a_stale_upstream_output_warns(run, caplog):
    sums = complete(run, "teacher", cfg(), [TEACHER])
    complete(run, "distill", cfg(), ["distill/model.safetensors"], inputs=sums)
    complete(run, "qat", cfg(), ["qat/qat.safetensors"], inputs={"distill/model.safetensors": "0" * 64})
    assert stage_states(run, STAGES)["qat"] == ("invalidated", "distill/model.safetensors changed since this stage "
                                                                "ran")
    run.update_stage("teacher", outputs={TEACHER: "1" * 64})  # the teacher ran again: distill is stale now
    with caplog.at_level(logging.WARNING):
        decide(run, cfg(), STAGES["qat"], False, STAGES, 1)
    assert "reading distill/model.safetensors from the distill stage, which is stale" in caplog.text
    caplog.clear()  # a dry run's plan, with distill running first: its file is about to be replaced, not read
    with caplog.at_level(logging.WARNING):
        decide(run, cfg(), STAGES["qat"], False, STAGES, 1, planning=True, running_first={"distill"})
    assert "which is stale" not in caplog.text


@pytest.mark.e2e
def test_changed_images_run_the_stages_again_and_a_teacher_of_other_classes_is_refused(tmp_path):
    """Images added or a class folder renamed run the stages again, and a teacher whose class indices mean other
    classes is refused, rather than distilled from (or failing with a bare size mismatch)."""
    image_tree(tmp_path / "img")
    args = ["run", "--run-dir", tmp_path / "run", "--set", "data.name=imagefolder", "--set",
            f"data.root={tmp_path / 'img'}", "--set", "data.image_size=8", "--set", "teacher.epochs=1", "--set",
            "model.teacher=compact_cnn", "--set", "model.student=compact_cnn", "--set", "distill.epochs=1",
            "--set", "distill.baseline=false"]
    first = invoke(*args, "--stages", "teacher,distill")
    assert first.exit_code == 0, first.output
    assert "teacher: up to date, skipped" in invoke(*args, "--stages", "teacher").stderr
    image_tree(tmp_path / "more", classes=("dog",), count=2)  # two more dog images, under new names
    for i, path in enumerate(sorted((tmp_path / "more" / "train" / "dog").iterdir())):
        shutil.copy(path, tmp_path / "img" / "train" / "dog" / f"new{i}.png")
    again = invoke(*args, "--stages", "teacher")
    assert again.exit_code == 0, again.output
    assert ("teacher: running again: the images in data.root changed (images added, removed, renamed, replaced, or "
            "moved between classes or between training and validation)") in again.stderr
    assert "teacher: up to date, skipped" in invoke(*args, "--stages", "teacher").stderr
    for split in ("train", "val"):
        os.rename(tmp_path / "img" / split / "cat", tmp_path / "img" / split / "bird")  # class 0 is now 'bird'
    before = file_bytes(tmp_path / "run")
    told = (f"teacher/model.safetensors was trained on 2 classes (cat, dog), but data.root now holds 2 classes "
            f"(bird, dog): the stages from teacher on must run again on these images - compress run --run-dir "
            f"{tmp_path / 'run'} --stages teacher,distill,qat,export")
    for stages in ("distill", "qat,export"):  # the earliest stage to redo named at once, in the dry run too
        for dry in ([], ["--dry-run"]):
            refused = invoke(*args, "--stages", stages, *dry)
            assert refused.exit_code == 2 and "Traceback" not in refused.output
            assert told in refused.stderr, refused.stderr
    assert {k: v for k, v in file_bytes(tmp_path / "run").items() if not k.endswith(("log.txt", "manifest.json"))} \
        == {k: v for k, v in before.items() if not k.endswith(("log.txt", "manifest.json"))}


@pytest.mark.e2e
def test_a_setting_that_cannot_change_the_result_does_not_run_the_stages_again(tmp_path, monkeypatch):
    """The same folder spelled with a trailing slash, relatively or through a link, a smaller image cache,
    data.download, data.val_fraction beside train/ and val/ folders, or data.flip set to its default cannot change
    the result, so none reruns the teacher and everything after it (a 31-minute teacher on the cifar10 recipe)."""
    image_tree(tmp_path / "img")
    os.symlink(tmp_path / "img", tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    args = ["run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--set", "data.name=imagefolder", "--set",
            "data.image_size=8", "--set", "teacher.epochs=1", "--set", "model.teacher=compact_cnn"]
    assert invoke(*args, "--set", f"data.root={tmp_path / 'img'}").exit_code == 0
    for change in (f"data.root={tmp_path / 'img'}/", "data.root=img", f"data.root={tmp_path / 'link'}",
                   "data.cache_mb=0", "data.download=true", "data.val_fraction=0.5", "data.flip=true"):
        root = [] if change.startswith("data.root") else ["--set", f"data.root={tmp_path / 'img'}"]
        result = invoke(*args, *root, "--set", change)
        assert "teacher: up to date, skipped" in result.stderr, (change, result.stderr)
    for change, key in (("data.flip=false", "data.flip"), ("data.eval_crop=0.5", "data.eval_crop")):
        result = invoke(*args, "--set", f"data.root={tmp_path / 'img'}", "--set", change)
        assert f"teacher: running again: config changed ({key})" in result.stderr, result.stderr
    result = invoke(*args, "--set", f"data.root={tmp_path / 'link'}/", "--set", "data.cache_mb=1", "--set",
                    "teacher.lr=0.05")  # only the key that can change the result is named
    assert "teacher: running again: config changed (teacher.lr)" in result.stderr, result.stderr


@pytest.mark.e2e
def test_a_stage_recorded_by_an_older_version_starts_following_its_images_once_skipped(tmp_path):
    """A teacher recorded without an image digest (as older versions did) is skipped after the upgrade - and then
    follows its images: a later change to them runs it again."""
    image_tree(tmp_path / "img")
    args = ["run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--set", "data.name=imagefolder", "--set",
            f"data.root={tmp_path / 'img'}", "--set", "data.image_size=8", "--set", "teacher.epochs=1", "--set",
            "model.teacher=compact_cnn"]
    assert invoke(*args).exit_code == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    digest = manifest["stages"]["teacher"]["inputs"].pop("external:images in data.root")
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(manifest))  # as the previous version wrote it
    assert "teacher: up to date, skipped" in invoke(*args).stderr
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stages"]["teacher"]["inputs"]["external:images in data.root"] == digest
    os.rename(tmp_path / "img" / "train" / "dog" / "0.png", tmp_path / "img" / "train" / "cat" / "9.png")
    assert "teacher: running again: the images in data.root changed" in invoke(*args).stderr


def test_a_resume_checkpoint_whose_extra_is_not_a_mapping_starts_over(run_copy):
    """A resume checkpoint whose extra is not a mapping starts over, in run, run --force and show alike, rather
    than fail with an unexpected TypeError."""
    path = run_copy / "teacher" / "last" / "checkpoint.safetensors"
    tensors, meta = read_safetensors(path)
    state = json.loads(meta["state"])
    state.update(extra=[1, 2], epoch=1)
    meta["state"] = json.dumps(state)
    path.write_bytes(serialize(tensors, meta))
    manifest = json.loads((run_copy / "manifest.json").read_text())
    manifest["stages"]["teacher"]["status"] = "interrupted"
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    show = compress_subprocess("show", run_copy, timeout=HANG)
    assert show.returncode == 0, show.stderr
    result = invoke("run", "--run-dir", run_copy, "--stages", "teacher", "--set", "teacher.epochs=1")
    assert result.exit_code == 0, result.output
    assert "the resume checkpoint is damaged ('extra' is list, not a mapping); starting over" in result.output


def test_train_clip_grad_norm_never_reruns_a_finished_stage(finished_run, tmp_path):
    """It is in `train` (how to run): a finished run is up to date under any value of it."""
    import shutil

    from conftest import invoke

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    result = invoke("run", "--run-dir", run, "--dry-run", "--set", "train.clip_grad_norm=1.0")
    assert result.exit_code == 0, result.output
    assert [line.split()[1] for line in result.output.splitlines() if line.split()[:1] and line.split()[0] in (
        "teacher", "distill", "qat", "export")] == ["skip"] * 4


def damage_tensors(path, edit):
    """Rewrite the resume checkpoint at `path` with `edit` applied to its tensors, its metadata kept as it was."""
    tensors, meta = read_safetensors(path)
    edit(tensors)
    atomic_write_bytes(path, serialize(tensors, meta))


def test_a_resume_checkpoint_whose_tensors_do_not_fit_or_are_not_finite_starts_over(run):
    """Tensors edited with the metadata kept (another shape or dtype, a tensor gone or added, NaN or inf) make the
    stage start over as damaged metadata does, the reason naming the file - not a resume that fails on load, or
    one that trains from NaN weights into a 'lower the learning rate' failure."""
    rel = checkpoint_rel("teacher")
    run.update_stage("teacher", status="interrupted")
    for edit, why in (
            (lambda t: t.update({"model.weight": torch.zeros(3, 2)}),
             "does not fit the model it was written for (wrong shape or dtype: model.weight (3, 2) float32, written "
             "as (2, 2) float32)"),
            (lambda t: t.update({"model.weight": t["model.weight"].to(torch.int32)}),
             "does not fit the model it was written for (wrong shape or dtype: model.weight (2, 2) int32, written as "
             "(2, 2) float32)"),
            (lambda t: t.pop("model.bias"), "does not fit the model it was written for (missing keys: model.bias)"),
            (lambda t: t.update({"model.extra": torch.zeros(2)}),
             "does not fit the model it was written for (unexpected keys: model.extra)"),
            (lambda t: t.update({"model.bias": torch.tensor([0.0, float("nan")])}),
             "holds NaN or infinite values in model.bias"),
            (lambda t: t.update({"model.weight": torch.full((2, 2), float("inf")),
                                 "model.bias": torch.tensor([1e39, 0.0])}),  # beyond float32: inf
             "holds NaN or infinite values in model.bias (and 1 more tensor)")):
        checkpoint(run, "teacher", cfg(), epoch=1, step=7)
        assert decide(run, cfg(), STAGES["teacher"], False, STAGES, 1).action == "resume"  # sound as written
        damage_tensors(run.path(rel), edit)
        state = decide(run, cfg(), STAGES["teacher"], False, STAGES, 1)
        assert (state.action, state.reason) == ("fresh", f"the resume checkpoint ({rel}) {why}; starting over")
        assert stage_states(run, STAGES)["teacher"] == ("interrupted", f"the resume checkpoint ({rel}) {why}; will "
                                                                       "start over")


@pytest.mark.e2e
def test_an_interrupted_teacher_whose_checkpoint_holds_nan_or_another_shape_starts_over(tmp_path, tiny_config):
    args = ["run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher", "--set", "data.limit=400"]
    assert invoke(*args).exit_code == 0
    path = tmp_path / "run" / checkpoint_rel("teacher")
    intact = path.read_bytes()
    for edit, why in (
            (lambda t: t.update({"model.classifier.weight": torch.zeros(10, 65)}),
             "does not fit the model it was written for (wrong shape or dtype: model.classifier.weight (10, 65) "
             "float32, written as (10, 64) float32)"),
            (lambda t: t.update({k: torch.full_like(v, float("nan")) for k, v in t.items() if v.is_floating_point()}),
             "holds NaN or infinite values in model.")):
        path.write_bytes(intact)
        tensors, meta = read_safetensors(path)  # interrupted after its first epoch
        meta["state"] = json.dumps({**json.loads(meta["state"]), "epoch": 1, "history": [{"val_acc": 50.0}]})
        path.write_bytes(serialize(tensors, meta))
        damage_tensors(path, edit)
        manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
        manifest["stages"]["teacher"]["status"] = "interrupted"
        (tmp_path / "run" / "manifest.json").write_text(json.dumps(manifest))
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert f"teacher: the resume checkpoint (teacher/last/checkpoint.safetensors) {why}" in result.stderr
        assert "; starting over" in result.stderr and "resuming from" not in result.stderr


def test_show_names_the_part_of_an_interrupted_distill_stage_that_resumes(run_copy):
    """Interrupted while training the student alone, the distill stage's main student has finished: show says
    the student alone resumes, at its epoch - not the main student's end, one epoch past the schedule."""
    proc = fault_subprocess("run", "--run-dir", run_copy, "--stages", "distill", "--force",
                            fault="distill baseline:1:3:sigint")
    assert proc.returncode == 130, proc.stderr[-2000:]
    shown = invoke("show", run_copy).output
    assert "distill  interrupted (its main model trained; baseline resumable at epoch 2, step " in shown, shown


def test_a_dry_run_plans_weights_to_download_as_the_file_it_recorded_when_the_name_vouches_for_it():
    """torchvision's weights files carry the start of their sha256 in their name, and a download is checked
    against it: a plan whose cache was emptied may take the recorded digest as the file it would fetch again;
    a recorded digest the name does not vouch for (a file placed by hand) is planned as changed."""
    from compress.models.weights import name_hash
    from compress.run.contract import File
    from compress.run.state import NOT_FETCHED, _to_be_fetched

    item = File("/nowhere/hub/checkpoints/resnet18-f37072fd.pth", "model.teacher_weights")
    assert name_hash(item.path) == "f37072fd" and name_hash("/x/teacher.pth") is None
    ours, other = "f37072fd" + "0" * 56, "ab" * 32
    assert _to_be_fetched(item, {"inputs": {item.input_key: ours}}) == ours
    assert _to_be_fetched(item, {"inputs": {item.input_key: other}}) == NOT_FETCHED
    assert _to_be_fetched(item, {}) == NOT_FETCHED
    assert _to_be_fetched(File("/x/teacher.pth", "model.teacher_weights"), {"inputs": {}}) == NOT_FETCHED
