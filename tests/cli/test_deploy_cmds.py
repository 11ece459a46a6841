"""`compress predict` and `compress bench` (compress.cli.deploy_cmds): warnings about the files they serve, the
installed script, errors in one line, two files side by side."""

import json
import re

import onnx
import pytest

from compress.cpus import usable_cpus
from conftest import compress_subprocess, invoke, write_val_pngs

pytestmark = pytest.mark.e2e


def test_predict_on_a_run_whose_export_is_stale_says_so(run_copy, tmp_path):
    """Predict on a run whose export is older than its qat stage warns that the int8 file it uses is stale and
    says how to bring the run up to date."""
    paths, _ = write_val_pngs(tmp_path, count=1)
    fresh = invoke("predict", run_copy, *paths)
    assert fresh.exit_code == 0 and "using model." in fresh.stderr and "warning" not in fresh.stderr
    assert invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.lr=0.0002").exit_code == 0
    result = invoke("predict", run_copy, *paths)
    assert result.exit_code == 0, result.output
    assert (f"warning: export is stale (qat/qat.safetensors changed since this stage ran): these files were made "
            f"before that; `compress run --run-dir {run_copy}` brings the run up to date") in result.stderr
    # a failed export, and a deployed file changed by hand after export checked it, are warned of too
    assert invoke("run", "--run-dir", run_copy, "--stages", "export", "--set", "export.min_int8_speedup=100",
                  "--set", "export.require_faster_int8=true").exit_code == 1
    failed = invoke("predict", run_copy, *paths)
    # the int8 file weighed is QAT's, or PTQ's when as accurate and 1.1x faster in every round (timing decides)
    assert re.search(r"warning: the last export failed \(export: (QAT|PTQ) int8 is ", failed.stderr), failed.output
    assert "its files are kept for inspection, not verified for deployment" in failed.stderr
    assert invoke("run", "--run-dir", run_copy, "--stages", "export", "--set", "export.min_int8_speedup=0",
                  "--set", "export.require_faster_int8=false").exit_code == 0
    deployed = json.loads((run_copy / "export" / "export.json").read_text())["verdict"]["file"]
    original = (run_copy / "export" / deployed).read_bytes()
    with open(run_copy / "export" / deployed, "ab") as f:
        f.write(b"\0")
    changed = invoke("predict", run_copy, *paths)
    assert f"warning: export/{deployed} changed after export wrote and checked it" in changed.stderr
    benched = invoke("bench", run_copy, "--batch", "1", "--threads", "1", "--repeats", "3")  # bench warns too
    assert f"warning: export/{deployed} changed after export wrote and checked it" in benched.stderr
    report = invoke("report", run_copy)
    assert report.exit_code == 0, report.output
    text = (run_copy / "report.md").read_text()  # the changed file is neither current nor the one to deploy
    assert f"export: export/{deployed} changed after the stage wrote it" in text and "Deploy export/" not in text
    rows = json.loads((run_copy / "report.json").read_text())["rows"]
    assert [r["current"] for r in rows if r["file"] == f"export/{deployed}"] == [False]
    (run_copy / "export" / deployed).write_bytes(original)
    manifest = json.loads((run_copy / "manifest.json").read_text())  # as a kill -9 during export leaves it
    manifest["stages"]["export"]["status"] = "running"
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    killed = invoke("predict", run_copy, *paths)
    assert "warning: the last export did not finish (interrupted)" in killed.stderr, killed.output
    (run_copy / "manifest.json").write_text("{not json")  # no readable manifest: the files are still served,
    unreadable = invoke("predict", run_copy, *paths)  # with a word that nothing checked them
    assert unreadable.exit_code == 0, unreadable.output
    assert (f"warning: manifest '{run_copy / 'manifest.json'}' is not valid JSON (JSONDecodeError); restore it, or "
            f"move it away and rerun the stage that wrote it - so {deployed} cannot be checked against what export "
            "verified") in unreadable.stderr


def test_predict_and_eval_warn_of_an_export_json_changed_by_hand(run_copy, tmp_path):
    """A verdict edited after export wrote export.json (another file named, another reason) is still served, but
    predict and eval say in one line that it is not verified and how to have export write it again."""
    paths, _ = write_val_pngs(tmp_path, count=1)
    export = run_copy / "export"
    (export / "other.onnx").write_bytes((export / "model.fp32.onnx").read_bytes())
    report = json.loads((export / "export.json").read_text())
    report["verdict"].update(file="other.onnx", why="all good")
    (export / "export.json").write_text(json.dumps(report))
    warning = ("warning: export/export.json changed after export wrote it: its verdict (other.onnx) is not verified; "
               f"rerun `compress run --run-dir {run_copy} --stages export --force`")
    predicted = invoke("predict", run_copy, *paths)
    assert predicted.exit_code == 0, predicted.output
    assert "using other.onnx, export's choice" in predicted.stderr
    assert warning in predicted.stderr and predicted.stderr.count("warning") == 1, predicted.stderr
    (tmp_path / "val" / "0").mkdir(parents=True)
    (tmp_path / "val" / "0" / "a.png").write_bytes((tmp_path / "val0.png").read_bytes())
    evaluated = invoke("eval", run_copy, tmp_path / "val")
    assert evaluated.exit_code == 0, evaluated.output
    assert warning in evaluated.stderr and evaluated.stderr.count("warning") == 1, evaluated.stderr
    # the report's ONNX rows are read from export.json: marked, with the reason, and none of them to deploy
    assert invoke("report", run_copy).exit_code == 0
    text = (run_copy / "report.md").read_text()
    assert "export: export/export.json changed after the stage wrote it" in text and "Deploy export/" not in text
    rows = json.loads((run_copy / "report.json").read_text())["rows"]
    assert {r["file"]: r["current"] for r in rows if r["file"] and r["file"].endswith(".onnx")} == {
        "export/model.fp32.onnx": False, "export/model.int8.onnx": False, "export/model.ptq.onnx": False}
    teacher = next(r for r in rows if r["id"] == "teacher")  # its latency came from export.json too: left out
    assert teacher["latency_b1_ms"] is None and teacher["latency_b64_ms"] is None, teacher


def test_predict_and_bench_from_the_installed_script(finished_run, tmp_path):
    paths, _ = write_val_pngs(tmp_path, count=2)
    model = finished_run / "export" / "model.int8.onnx"
    proc = compress_subprocess("predict", model, *paths)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("%") == 6  # two images, top-3 each
    proc = compress_subprocess("bench", model, "--batch", "1,4", "--threads", "1", "--repeats", "3")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 4  # title, header, two rows
    for where in (finished_run, finished_run / "export"):  # a run directory: its fp32 file against its int8 one
        proc = compress_subprocess("bench", where, "--batch", "4", "--threads", "1", "--repeats", "3")
        assert proc.returncode == 0, proc.stderr
        assert f"A = {finished_run / 'export' / 'model.fp32.onnx'}" in proc.stdout
        assert f"B = {finished_run / 'export' / 'model.int8.onnx'}" in proc.stdout
    proc = compress_subprocess("predict", finished_run / "export", *paths, "--json")  # its export/ folder too
    assert proc.returncode == 0 and "using model." in proc.stderr, proc.stderr
    assert [r["image"] for r in json.loads(proc.stdout)] == [str(p) for p in paths]
    (tmp_path / "broken.png").write_bytes(b"not an image")  # an unreadable one is in the JSON too, not only stderr
    proc = compress_subprocess("predict", model, paths[0], tmp_path / "broken.png", "--json")
    assert proc.returncode == 2
    listed = json.loads(proc.stdout)
    assert "top" in listed[0] and listed[1]["image"] == str(tmp_path / "broken.png")
    assert listed[1]["error"].startswith("cannot read image")


def test_deployment_errors_are_one_clear_line(finished_run, tmp_path):
    model = finished_run / "export" / "model.int8.onnx"
    bare = tmp_path / "bare.onnx"
    proto = onnx.load(model)
    del proto.metadata_props[:]
    onnx.save(proto, bare)
    (tmp_path / "junk.onnx").write_bytes(b"\x00garbage")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    cases = [
        (("predict", tmp_path / "missing.onnx", "x.png"), "not found"),
        (("predict", tmp_path / "junk.onnx", "x.png"), "is not an ONNX model"),
        (("predict", bare, "x.png"), "has no compress metadata for class_names"),
        (("predict", model, tmp_path / "broken.png"), "cannot read image"),
        (("predict", model, tmp_path / "absent.png"), "not found"),
        (("bench", tmp_path / "junk.onnx"), "is not an ONNX model"),
        (("bench", tmp_path / "absent"), f"'{tmp_path / 'absent'}' does not exist; pass .onnx files, or a run"),
        (("bench", model, "--batch", "0"), "positive whole numbers"),
        (("bench", model, "--threads", "2,2"), "give each value once, got '2,2'"),
        (("bench", tmp_path), "is a folder without export/export.json; pass an .onnx file, or a run directory whose "
                              "export stage ran"),  # no run there: nothing to finish
        (("predict", tmp_path / "half", "x.png"), f"pass an .onnx file, or finish this run first (compress run "
                                                  f"--run-dir {tmp_path / 'half'})"),  # a run without its export
        # no images at all is an error, not a silent exit 0
        (("predict", model, tmp_path / "empty"), f"no images in '{tmp_path / 'empty'}': give image files"),
        (("eval", finished_run, tmp_path / "absent"), "is not a folder"),
        (("eval", tmp_path / "no-run", tmp_path), f"'{tmp_path / 'no-run'}' does not exist"),
        # a --png path that cannot be written is refused before the evaluation, in a sentence
        (("eval", finished_run, tmp_path, "--png", tmp_path / "nodir" / "c.png"), "does not exist; create it"),
        (("eval", finished_run, tmp_path, "--png", tmp_path / "c.txt"), "give a file name ending in .png"),
    ]
    (tmp_path / "empty").mkdir()
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "manifest.json").write_text("{}")
    (tmp_path / "empty" / "notes.txt").write_text("no image here")
    for args, message in cases:
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and "Traceback" not in result.output


def test_bench_compares_two_files_side_by_side(finished_run):
    fp32, int8 = (finished_run / "export" / f"model.{k}.onnx" for k in ("fp32", "int8"))
    result = invoke("bench", fp32, int8, "--batch", "1,8", "--threads", "1", "--repeats", "5")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()  # stderr may hold a note that the machine is busy
    assert "interleaved rounds" in lines[2] and len(lines) == 6
    assert all(("faster than" in line or "slower than" in line) for line in lines[4:])


@pytest.mark.skipif(usable_cpus() < 2, reason="with one CPU the default thread counts are already [1]")
def test_bench_on_a_run_directory_times_its_export_latency_threads(run_copy):
    """`compress bench RUN_DIR` times a run's files as its report did: its export.latency_threads too."""
    import yaml

    config = run_copy / "config.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["export"]["latency_threads"] = [1]
    config.write_text(yaml.safe_dump(cfg))
    result = invoke("bench", run_copy, "--batch", "4", "--repeats", "3", "--json")
    assert result.exit_code == 0, result.output
    files = json.loads(result.stdout)["files"]
    assert {c["threads"] for f in files for c in f["cells"]} == {1}


def test_a_file_name_with_a_line_break_cannot_print_a_line_of_its_own(finished_run, tmp_path):
    """predict prints one line an image: a name holding a line break (and what looks like a prediction) is escaped,
    in the results and in the skipped lines alike."""
    paths, _ = write_val_pngs(tmp_path, count=1)
    folder = tmp_path / "names"
    folder.mkdir()
    forged = folder / "a.png: 7 (100.0%)\nb.png"
    forged.write_bytes(open(paths[0], "rb").read())
    (folder / "bad\nname.png").write_bytes(b"not an image")
    result = invoke("predict", finished_run, folder, "--top-k", "1")
    assert result.exit_code == 2, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{folder}/a.png: 7 (100.0%)\\nb.png: "), result.stdout
    skipped = [line for line in result.stderr.splitlines() if line.startswith("skipped:")]
    assert len(skipped) == 1 and "bad\\nname.png" in skipped[0], result.stderr


def test_predict_while_a_run_is_at_work_in_the_directory_says_so(run_copy, tmp_path):
    """An export that is running now is not 'an export that did not finish': predict names the run at work."""
    import subprocess
    import sys

    paths, _ = write_val_pngs(tmp_path, count=1)
    manifest = json.loads((run_copy / "manifest.json").read_text())  # as a running export leaves it
    manifest["stages"]["export"]["status"] = "running"
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom compress.run.rundir import RunDir, "
                               "RunLock\nRunLock(RunDir(sys.argv[1])).acquire()\nprint('held', flush=True)\n"
                               "time.sleep(60)", str(run_copy)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = invoke("predict", run_copy, *paths)
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 0, result.output
    assert f"warning: a compress run is working in {run_copy} now (pid {holder.pid}" in result.stderr
    assert "the last export did not finish" in invoke("predict", run_copy, *paths).stderr
