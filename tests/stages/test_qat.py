"""The QAT stage (stages/qat.py): the accuracy budget and what its failure says, the timed choice of float
layers and the setting that fixes it."""

import json
import re
import shutil

from conftest import invoke


def test_the_qat_stage_says_how_to_fix_its_timed_choice_and_the_setting_it_names_works(run_copy):
    """The qat stage's float-layer choice follows timings, so the same config can give different int8 files from
    run to run: the stage names the setting that holds it still, and that setting works."""
    import re

    from conftest import invoke

    timed = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.float_layers=null")
    assert timed.exit_code == 0, timed.output
    log = (run_copy / "log.txt").read_text()
    setting = re.findall(r"a choice made from timings, which a busy machine can change: --set '(qat\.float_layers="
                         r"\[[^\]]*\])' fixes it", log)[-1]
    chosen = json.loads((run_copy / "manifest.json").read_text())["stages"]["qat"]["metrics"]["float_layers"]
    fixed = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", setting)
    assert fixed.exit_code == 0, fixed.output
    assert json.loads((run_copy / "manifest.json").read_text())["stages"]["qat"]["metrics"]["float_layers"] == chosen


def test_a_qat_budget_failure_says_which_keys_to_change(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    result = invoke("run", "--run-dir", run, "--stages", "qat", "--set", "qat.max_accuracy_drop=0",
                    "--set", "qat.optimizer=sgd", "--set", "qat.lr=2")
    assert result.exit_code == 1, result.output
    message = result.stderr.strip().splitlines()[-1]
    assert "over the budget qat.max_accuracy_drop=0.0; accept the loss with --set qat.max_accuracy_drop=" in message
    assert "(this model is judged again, not retrained; export still weighs onnxruntime's post-training " \
           "quantization beside it)" in message
    assert "(--set qat.epochs=4) or a gentler learning rate (--set qat.lr=1)" in message
    counted = re.search(r"points below the float model's [0-9.]+% \(([0-9]+) of ([0-9,]+) validation images\)", message)
    images = int(counted.group(2).replace(",", ""))
    assert f"one validation image is worth {100 / images:.2f} points here, more than the budget" in message
    assert (run / "log.txt").read_text().strip().splitlines()[-1].endswith(f"ERROR {message}")  # kept with the run
    report = (run / "report.md").read_text()  # the report says qat failed rather than lose its rows
    assert "- qat failed: qat: int8 accuracy" in report
    again = invoke("run", "--run-dir", run, "--stages", "qat")  # a failed run is not taken for an interrupted one
    assert "qat: the last run failed (qat: int8 accuracy" in again.stderr
    # the advice taken: the same model judged by the budget it names, not trained again
    allow = re.search(r"accept the loss with --set (qat\.max_accuracy_drop=[0-9]+)", message).group(1)
    weights = (run / "qat" / "qat.safetensors").read_bytes()
    accepted = invoke("run", "--run-dir", run, "--stages", "qat", "--set", allow, "--set", "qat.optimizer=sgd",
                      "--set", "qat.lr=2")
    assert accepted.exit_code == 0, accepted.output
    assert f"continuing from its checkpoint after its last epoch to judge its model by {allow.replace('=', ' ')}" \
        in accepted.stderr
    assert "epoch 1/" not in accepted.stderr  # no epoch trained
    assert (run / "qat" / "qat.safetensors").read_bytes() == weights
    # a completed stage and another budget: within it, skipped; beyond it, judged again from its checkpoint
    drop = json.loads((run / "manifest.json").read_text())["stages"]["qat"]["metrics"]["accuracy_drop"]
    same = ["--set", "qat.optimizer=sgd", "--set", "qat.lr=2"]
    looser = invoke("run", "--run-dir", run, "--stages", "qat", "--set", f"qat.max_accuracy_drop={drop + 5:g}", *same)
    assert looser.exit_code == 0 and "qat: up to date, skipped (same config and inputs; its result passes " \
        "qat.max_accuracy_drop" in looser.stderr, looser.stderr
    tighter = invoke("run", "--run-dir", run, "--stages", "qat", "--set", f"qat.max_accuracy_drop={drop / 2:g}", *same)
    assert tighter.exit_code == 1, tighter.output
    assert f"its accuracy_drop {drop:g} is over qat.max_accuracy_drop {drop / 2:g}: judging its model again from its " \
        "checkpoint after its last epoch" in tighter.stderr
    assert "epoch 1/" not in tighter.stderr and "over the budget" in tighter.stderr
    assert (run / "qat" / "qat.safetensors").read_bytes() == weights


def test_qat_accuracy_budget_fails_the_stage_and_keeps_its_outputs(run_copy):
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.optimizer=sgd",
                    "--set", "qat.lr=3", "--set", "qat.max_accuracy_drop=1")
    assert result.exit_code == 1, result.output
    assert "over the budget qat.max_accuracy_drop=1.0" in result.stderr and "Traceback" not in result.output
    assert (run_copy / "qat" / "qat.safetensors").is_file()
    assert json.loads((run_copy / "manifest.json").read_text())["stages"]["qat"]["status"] == "failed"
    shown = invoke("show", run_copy).output
    assert "qat      failed (qat: int8 accuracy" in shown


def test_the_float_layer_choice_says_its_rule(run_copy):
    """The "kept float:" line says its rule - a layer stays float only where that pays 5 % - so a layer listed as
    faster in float yet kept int8 is explained."""
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.float_layers=null")
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if "kept float:" in x)
    assert "a layer stays float only where that makes the student at least 5% faster, so one a little faster in " \
        "float stays int8" in line
    assert "(kept float)" in line or "(stays int8)" in line
    # like teacher and distill, the stage says what it trains in and on how many threads (results repeat at one)
    assert "qat: trains in fp32 (always: the observers learn int8 ranges in fp32) on " in result.output


def test_qat_source_baseline_quantizes_and_ships_the_student_trained_alone(run_copy):
    """qat.source: baseline starts QAT from distill/baseline.safetensors and export ships the files made from
    it: the weights' parent hashes name the student alone, not the distilled one."""
    import onnx

    from compress.deploy.onnx_model import metadata_of
    from compress.fileio import sha256_file
    from compress.training.checkpoint import read_metadata

    result = invoke("run", "--run-dir", run_copy, "--stages", "qat,export", "--set", "qat.source=baseline")
    assert result.exit_code == 0, result.output
    alone, distilled = (sha256_file(run_copy / "distill" / f) for f in ("baseline.safetensors", "model.safetensors"))
    assert alone != distilled
    assert read_metadata(run_copy / "qat" / "qat.safetensors")["parent_sha256"] == alone
    assert metadata_of(onnx.load(run_copy / "export" / "model.fp32.onnx"))["source_sha256"] == alone
    manifest = json.loads((run_copy / "manifest.json").read_text())["stages"]
    assert manifest["qat"]["inputs"].get("distill/baseline.safetensors") == alone
    report = (run_copy / "report.md").read_text()  # the shipped files say whose they are
    assert "| the student trained alone's int8 ONNX (onnxruntime)" in report, report
    again = invoke("run", "--run-dir", run_copy, "--stages", "qat,export", "--set", "qat.source=baseline")
    assert again.exit_code == 0
    assert "qat: up to date, skipped" in again.stderr and "export: up to date, skipped" in again.stderr


def test_qat_source_baseline_without_a_student_alone_is_refused_before_anything_runs(run_copy):
    before = (run_copy / "manifest.json").read_text()
    result = invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.source=baseline",
                    "--set", "distill.baseline=false")
    assert result.exit_code == 2, result.output
    assert ("qat.source: baseline quantizes the student trained alone, which distill.baseline: false does not train; "
            "set distill.baseline=true, or qat.source=distill") in result.stderr
    assert (run_copy / "manifest.json").read_text() == before
