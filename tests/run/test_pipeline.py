"""The pipeline (compress.run.pipeline) on the tiny config: the documented tree, reruns that skip or redo,
the stages a rerun made stale, the config a run saves, and the plan of a dry run."""

import json
import os
import shutil

import pytest
import torch
import yaml

from compress.run.config import load_config
from conftest import file_bytes, image_tree, invoke, tree

pytestmark = pytest.mark.e2e

EXPECTED_TREE = [
    "config.yaml",
    "distill/baseline.safetensors", "distill/baseline/last/checkpoint.safetensors", "distill/baseline/metrics.json",
    "distill/baseline/tensorboard/events", "distill/last/checkpoint.safetensors", "distill/metrics.json",
    "distill/model.safetensors", "distill/tensorboard/events",
    "export/export.json", "export/model.fp32.onnx", "export/model.int8.onnx", "export/model.ptq.onnx",
    "log.txt", "manifest.json",
    "qat/last/checkpoint.safetensors", "qat/metrics.json", "qat/qat.safetensors", "qat/tensorboard/events",
    "report.json", "report.md", "report.png",
    "teacher/last/checkpoint.safetensors", "teacher/metrics.json", "teacher/model.safetensors",
    "teacher/tensorboard/events",
]


def test_full_run_writes_exactly_the_documented_tree(finished_run, tiny_config):
    """(The tiny config has a hint loss, so the teacher runs on every batch: no teacher-output store. TensorBoard
    event files, named by time, host and process, are written when TensorBoard is installed.)"""
    import importlib.util

    found = sorted({os.path.dirname(p) + "/events" if "tfevents" in p else p for p in tree(finished_run)})
    expected = EXPECTED_TREE if importlib.util.find_spec("tensorboard") else [
        p for p in EXPECTED_TREE if not p.endswith("/events")]
    assert found == expected
    manifest = json.loads((finished_run / "manifest.json").read_text())
    assert [s["status"] for s in manifest["stages"].values()] == ["complete"] * 4
    assert load_config(str(finished_run / "config.yaml")) == load_config(tiny_config)
    assert (finished_run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metrics_hold_every_epoch_and_every_loss_term(finished_run):
    epochs = json.loads((finished_run / "distill" / "metrics.json").read_text())["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert {"train_ce", "train_kd", "train_hint", "val_acc", "images_per_s"} <= set(epochs[0])
    qat = json.loads((finished_run / "qat" / "metrics.json").read_text())["epochs"]
    assert all("int8_acc" in e and "val_acc" in e for e in qat)
    assert all({"train_ce", "train_kd"} <= set(e) for e in qat)  # labels + distillation from the float model


def test_rerun_skips_everything_and_changes_nothing(run_copy):
    before = file_bytes(run_copy)
    result = invoke("run", "--run-dir", run_copy)
    assert result.exit_code == 0, result.output
    assert result.stderr.count("up to date, skipped") == 4
    after = file_bytes(run_copy)
    assert {k: v for k, v in after.items() if not k.startswith("report")} == \
        {k: v for k, v in before.items() if not k.startswith("report")}


def test_force_redoes_a_stage_and_a_changed_value_reruns_it(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "export", "--force")
    assert result.exit_code == 0 and "export: running (--force)" in result.stderr
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.lr=0.0002")
    assert result.exit_code == 0, result.output
    assert "qat: running again: config changed (qat.lr)" in result.stderr


def test_upstream_change_invalidates_downstream(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "teacher", "--set", "teacher.epochs=1")
    assert result.exit_code == 0, result.output
    shown = invoke("show", run_copy).output
    assert "distill  invalidated (teacher/model.safetensors changed since this stage ran)" in shown
    result = invoke("run", "--run-dir", run_copy, "--stages", "distill")
    assert "distill: running again: its input teacher/model.safetensors changed" in result.stderr


def test_a_downstream_stage_of_an_interrupted_rerun_is_not_said_to_have_a_changed_input(run_copy):
    """A teacher rerun (--force) that was interrupted leaves its model file as it was: distill is out of date
    because the teacher is being redone, not because teacher/model.safetensors changed."""
    path = run_copy / "manifest.json"
    manifest = json.loads(path.read_text())  # what an interrupted rerun records: no outputs yet
    manifest["stages"]["teacher"].update(status="interrupted", outputs={})
    path.write_text(json.dumps(manifest))
    shown = invoke("show", run_copy).output
    assert "distill  invalidated (teacher was interrupted)" in shown, shown
    assert "changed since this stage ran" not in shown


def test_a_stage_needs_its_input(tmp_path, tiny_config):
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "empty", "--stages", "distill")
    assert result.exit_code == 2
    assert "run the teacher stage first: teacher/model.safetensors is not in" in result.stderr


@pytest.mark.parametrize("stages, missing", [
    ("teacher,export", "export: run the distill stage first: distill/model.safetensors is not in "),
    ("teacher,export", "; and run the qat stage first: qat/qat.safetensors is not in "),  # both, not one by one
    ("teacher,distill,export", "export: run the qat stage first: qat/qat.safetensors"),
    ("teacher,qat", "qat: run the distill stage first: distill/model.safetensors"),
])
def test_a_stage_whose_input_no_earlier_stage_writes_stops_before_the_teacher_trains(tmp_path, tiny_config, stages,
                                                                                      missing):
    """A stage whose inputs no chosen stage makes is refused up front, by --dry-run, the run and the launcher
    alike, before the teacher trains for nothing."""
    for launch in (["--dry-run"], [], ["--nproc-per-node", "2"]):  # the launcher refuses before torchrun starts
        result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "new", "--stages", stages, *launch)
        assert result.exit_code == 2, result.output
        assert missing in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "new").exists()


def test_resolved_config_is_written_and_reused(run_copy):
    cfg = yaml.safe_load((run_copy / "config.yaml").read_text())
    assert cfg["data"]["name"] == "digits" and cfg["teacher"]["epochs"] == 2


def test_a_single_stage_rerun_names_the_stages_it_made_stale(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    result = invoke("run", "--run-dir", run, "--stages", "distill", "--set", "distill.epochs=1")
    assert result.exit_code == 0, result.output
    assert f"qat and export are now stale (distill/model.safetensors changed since this stage ran); refresh with: " \
           f"compress run --run-dir {run} --stages qat,export" in result.stderr
    assert "made with another config" not in result.stderr  # distill.epochs is distill's alone


def test_a_set_for_one_stage_names_the_other_stages_it_leaves_behind(run_copy):
    """`--stages export --set data.eval_crop=0.875` names the other stages it leaves made with another config than
    config.yaml now holds, which the next plain run reruns; a `--set` that changes nothing that counts
    (data.cache_mb) names nobody."""
    result = invoke("run", "--run-dir", run_copy, "--stages", "export", "--set", "data.eval_crop=0.875")
    assert result.exit_code == 0, result.output
    assert ("teacher, distill and qat were made with another config than the one config.yaml now holds "
            f"(data.eval_crop): the next `compress run --run-dir {run_copy}` runs them again; to keep them, set that "
            "key back (--set) or pass the config they were made with (-c)") in result.stderr
    plan = invoke("run", "--run-dir", run_copy, "--dry-run").output
    assert [line.split()[1] for line in plan.splitlines() if line.split()[:1] in (["teacher"], ["qat"])] == ["run"] * 2
    quiet = invoke("run", "--run-dir", run_copy, "--stages", "export", "--set", "data.eval_crop=1.0", "--set",
                   "data.cache_mb=1")
    assert quiet.exit_code == 0 and "made with another config" not in quiet.stderr, quiet.stderr
    # a key only a stage left out reads is not written to config.yaml, and a run that skipped every stage writes
    # nothing - neither leaves a stage behind
    for args in (["--stages", "qat", "--set", "teacher.epochs=3", "--set", "qat.epochs=1"],
                 ["--stages", "teacher", "--set", "distill.epochs=5"]):
        result = invoke("run", "--run-dir", run_copy, *args)
        assert result.exit_code == 0 and "made with another config" not in result.stderr, (args, result.stderr)


def test_dry_run_says_what_each_stage_would_do_and_writes_nothing(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = sorted(os.listdir(run))
    result = invoke("run", "--run-dir", run, "--dry-run", "--set", "distill.epochs=3")
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.split()[0] in
             ("teacher", "distill", "qat", "export")}
    assert lines["teacher"].split()[1] == "skip"
    assert lines["distill"].split()[1] == "run" and "config changed (distill.epochs)" in lines["distill"]
    assert "distill runs first and replaces distill/model.safetensors" in lines["qat"]
    assert ("distill and qat run first and replace distill/model.safetensors and qat/qat.safetensors"
            in lines["export"])  # export reads both (and the teacher, which does not run): the plan names both
    assert sorted(os.listdir(run)) == before and torch is not None
    fresh = invoke("run", "--run-dir", tmp_path / "new", "--dry-run")
    teacher = next(line for line in fresh.stdout.splitlines() if line.startswith("teacher"))
    assert fresh.exit_code == 0 and "not run yet" in teacher
    export = next(line for line in fresh.stdout.splitlines() if line.startswith("export"))
    assert ("after teacher, distill and qat, which write teacher/model.safetensors, distill/model.safetensors and "
            "qat/qat.safetensors") in export
    assert not (tmp_path / "new").exists()


def test_an_override_for_a_stage_that_does_not_run_is_not_saved(run_copy):
    before = yaml.safe_load((run_copy / "config.yaml").read_text())
    result = invoke("run", "--run-dir", run_copy, "--stages", "export", "--set", "teacher.epochs=1")
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((run_copy / "config.yaml").read_text())
    assert saved["teacher"]["epochs"] == before["teacher"]["epochs"] == 2
    again = invoke("run", "--run-dir", run_copy, "--stages", "teacher")
    assert again.exit_code == 0 and "teacher: up to date, skipped" in again.stderr


def test_a_stage_that_runs_saves_its_own_keys_only(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.lr=0.0002",
                    "--set", "distill.epochs=9")
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((run_copy / "config.yaml").read_text())
    assert saved["qat"]["lr"] == 0.0002 and saved["distill"]["epochs"] == 2


def test_a_key_the_running_stage_leaves_out_is_not_saved_so_later_stages_stay_done(run_copy, tmp_path):
    """qat reads every `data` key but data.unlabeled: a --set of it with `--stages qat` is not saved as if qat had
    used it, so the next plain run does not find distill's config changed."""
    from conftest import write_val_pngs

    (tmp_path / "unlabelled").mkdir()
    write_val_pngs(tmp_path / "unlabelled")
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--force", "--set",
                    f"data.unlabeled={tmp_path / 'unlabelled'}")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((run_copy / "config.yaml").read_text())["data"].get("unlabeled") is None
    plan = invoke("run", "--run-dir", run_copy, "--dry-run")
    assert plan.exit_code == 0, plan.output
    assert "config changed" not in plan.output


def test_a_stage_an_earlier_version_finished_stays_done_when_only_how_its_config_is_hashed_changed(run_copy):
    """An earlier version hashed the config its own way (a path spelled relative, a key that no longer counts): its
    manifest's hashes then match nothing, but the config slice it recorded, compared as it counts today, does - so
    the stage is not run again. A slice that differs where it counts still reruns."""
    path = run_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    for entry in manifest["stages"].values():
        entry["config_hash"], entry["result_hash"] = "0" * 16, "1" * 16
    path.write_text(json.dumps(manifest))
    plan = invoke("run", "--run-dir", run_copy, "--dry-run")
    assert plan.exit_code == 0, plan.output
    assert all(f"{stage:<8} skip" in plan.output for stage in ("teacher", "distill", "qat", "export")), plan.output
    manifest["stages"]["teacher"]["config"]["teacher"]["epochs"] += 1
    path.write_text(json.dumps(manifest))
    plan = invoke("run", "--run-dir", run_copy, "--dry-run")
    assert "teacher  run     config changed (teacher.epochs)" in plan.output, plan.output


@pytest.mark.e2e
def test_another_data_root_in_a_run_directory_says_once_that_its_models_are_replaced(tmp_path):
    """Pointing a finished run at other photos reruns its stages - and replaces the models of the first photos:
    the dry run and the run say so once, with --name for keeping them."""
    image_tree(tmp_path / "first")
    image_tree(tmp_path / "second", classes=("ant", "bee"))
    args = ["run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--set", "data.name=imagefolder", "--set",
            "data.image_size=8", "--set", "teacher.epochs=1", "--set", "model.teacher=compact_cnn"]
    first = invoke(*args, "--set", f"data.root={tmp_path / 'first'}")
    assert first.exit_code == 0, first.output
    assert "data.root changed" not in first.output
    planned = invoke(*args, "--set", f"data.root={tmp_path / 'second'}", "--dry-run")
    assert planned.exit_code == 0, planned.output
    assert "note: data.root changed: the models this run directory holds, trained on the earlier images, are " \
           "replaced as their stages run again; --name NEW" in planned.stdout, planned.stdout
    ran = invoke(*args, "--set", f"data.root={tmp_path / 'second'}")
    assert ran.exit_code == 0 and ran.stderr.count("data.root changed: the models this run directory holds") == 1
