import json
import os

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from compress.data.datasets import load_data
from compress.deploy.onnx_model import OnnxModel, metadata_of, optimized_op_types
from compress.errors import InputError
from compress.models.registry import build_model
from compress.quant.onnx_export import export_onnx
from compress.run.config import load_config
from conftest import ROOT, compress_subprocess, invoke


@pytest.mark.parametrize("name,shape", [("light_cnn", (3, 32, 32)), ("deep_cnn", (1, 28, 28)),
                                        ("resnet18", (3, 32, 32))])
def test_registry_models_export_check_and_match_onnxruntime(tmp_path, name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 10).eval()
    path = tmp_path / "m.onnx"
    export_onnx(model, torch.randn(2, *shape), path, 17, {"class_names": list("abcdefghij")})
    onnx.checker.check_model(onnx.load(path), full_check=True)
    session = OnnxModel(str(path), require_metadata=False)
    x = torch.randn(5, *shape)  # a batch size the export never saw: the batch axis is dynamic
    with torch.no_grad():
        expected = model(x).numpy()
    assert np.abs(session(x.numpy()) - expected).max() < 1e-3


def test_export_json_reports_parity_sizes_kernels_and_latency(finished_run):
    report = json.loads((finished_run / "export" / "export.json").read_text())
    assert report["fp32"]["top1_agreement"] == 1.0 and report["fp32"]["max_abs_diff"] < 1e-3
    assert report["int8"]["top1_agreement"] >= 0.99
    assert set(report["int8_kernels"]) & {"QLinearConv", "QGemm"}
    assert report["size_bytes"]["int8"] < 0.35 * report["size_bytes"]["fp32"]
    assert {(c["batch"], c["threads"]) for c in report["latency_ms"]["int8"]} >= {(1, 1), (8, 1)}
    assert all(c["ok"] for c in report["checks"].values())


def test_int8_onnx_really_is_int8(finished_run):
    path = finished_run / "export" / "model.int8.onnx"
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    weights = [i for i in onnx.load(path).graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) > 1]
    assert weights, "weights are stored as int8"
    assert "QLinearConv" in optimized_op_types(str(path))


def test_metadata_round_trip(finished_run):
    meta = metadata_of(onnx.load(finished_run / "export" / "model.int8.onnx"))
    data = load_data(load_config(None, ["data.name=digits"]).data, seed=0)
    assert meta["class_names"] == list(data.class_names)
    assert meta["input_shape"] == [1, 8, 8] and meta["channel_order"] == "gray"
    assert meta["mean"] == pytest.approx(list(data.mean)) and meta["std"] == pytest.approx(list(data.std))
    assert meta["precision"] == "int8" and meta["qconfig"]["backend"] == "x86" and len(meta["source_sha256"]) == 64


def write_val_pngs(tmp_path, count=6):
    data = load_data(load_config(None, ["data.name=digits"]).data, seed=0)
    images, labels = data.val.raw(list(range(count)))
    paths = []
    for i, img in enumerate(images):
        path = tmp_path / f"val{i}.png"
        Image.fromarray(img[0].numpy()).save(path)
        paths.append(str(path))
    x = data.val.batch(range(count)).x
    return paths, x


def test_predict_gives_the_labels_pytorch_gives(finished_run, tmp_path):
    paths, x = write_val_pngs(tmp_path)
    model = build_model("compact_cnn", (1, 8, 8), 10).eval()
    from compress.training.checkpoint import load_weights
    load_weights(model, finished_run / "distill" / "model.safetensors")
    with torch.no_grad():
        expected = [str(i) for i in model(x).argmax(1).tolist()]
    result = invoke("predict", finished_run / "export" / "model.fp32.onnx", *paths, "--json", "--top-k", "2")
    assert result.exit_code == 0, result.output
    got = [entry["top"][0]["class"] for entry in json.loads(result.stdout)]
    assert got == expected


def test_predict_on_a_run_whose_export_is_stale_says_so(run_copy, tmp_path):
    """Was: after `--stages qat` ran again, predict used the old int8 file with no word of it."""
    paths, _ = write_val_pngs(tmp_path, count=1)
    fresh = invoke("predict", run_copy, *paths)
    assert fresh.exit_code == 0 and "using model." in fresh.stderr and "warning" not in fresh.stderr
    assert invoke("run", "--run-dir", run_copy, "--stages", "qat", "--set", "qat.lr=0.0002").exit_code == 0
    result = invoke("predict", run_copy, *paths)
    assert result.exit_code == 0, result.output
    assert (f"warning: export is stale (qat/qat.safetensors changed since this stage ran): these files were made "
            f"before that; `compress run --run-dir {run_copy}` brings the run up to date") in result.stderr
    # a failed export, and a deployed file changed by hand after export checked it (was: served without a word)
    assert invoke("run", "--run-dir", run_copy, "--stages", "export", "--set", "export.min_int8_speedup=100",
                  "--set", "export.require_faster_int8=true").exit_code == 1
    failed = invoke("predict", run_copy, *paths)
    assert "warning: the last export failed (export: QAT int8 is" in failed.stderr, failed.output
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
    text = (run_copy / "report.md").read_text()  # was: every row current, and "Deploy export/..." the changed file
    assert f"export: export/{deployed} changed after the stage wrote it" in text and "Deploy export/" not in text
    rows = json.loads((run_copy / "report.json").read_text())["rows"]
    assert [r["current"] for r in rows if r["file"] == f"export/{deployed}"] == [False]
    (run_copy / "export" / deployed).write_bytes(original)
    manifest = json.loads((run_copy / "manifest.json").read_text())  # as a kill -9 during export leaves it
    manifest["stages"]["export"]["status"] = "running"
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    killed = invoke("predict", run_copy, *paths)
    assert "warning: the last export did not finish (interrupted)" in killed.stderr, killed.output
    (run_copy / "manifest.json").write_text("{not json")  # no readable manifest: the files are still served
    unreadable = invoke("predict", run_copy, *paths)
    assert unreadable.exit_code == 0 and "warning" not in unreadable.stderr, unreadable.output


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
        (("bench", model, "--batch", "0"), "positive whole numbers"),
        (("bench", tmp_path), "is a folder without export/export.json"),
        # was: exit 0 and no output at all
        (("predict", model, tmp_path / "empty"), f"no images in '{tmp_path / 'empty'}': give image files"),
        (("eval", finished_run, tmp_path / "absent"), "is not a folder"),
        (("eval", tmp_path / "no-run", tmp_path), f"'{tmp_path / 'no-run'}' does not exist"),
        # was: the whole evaluation first, then "unexpected FileNotFoundError" / ValueError, exit 1
        (("eval", finished_run, tmp_path, "--png", tmp_path / "nodir" / "c.png"), "does not exist; create it"),
        (("eval", finished_run, tmp_path, "--png", tmp_path / "c.txt"), "give a file name ending in .png"),
    ]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no image here")
    for args, message in cases:
        result = invoke(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and "Traceback" not in result.output


def test_onnx_model_refuses_a_file_without_metadata_only_when_asked(finished_run, tmp_path):
    bare = tmp_path / "bare.onnx"
    proto = onnx.load(finished_run / "export" / "model.fp32.onnx")
    del proto.metadata_props[:]
    onnx.save(proto, bare)
    with pytest.raises(InputError):
        OnnxModel(str(bare))
    assert OnnxModel(str(bare), require_metadata=False).input_shape == (1, 8, 8)


def test_int8_graph_is_clean_qdq_without_casts(finished_run):
    """No Cast between QuantizeLinear and DequantizeLinear: the pair other runtimes pattern-match stays whole."""
    graph = onnx.load(finished_run / "export" / "model.int8.onnx").graph
    producers = {out: node for node in graph.node for out in node.output}
    assert not [n for n in graph.node if n.op_type == "Cast"]
    dequantized = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in producers]
    assert dequantized and all(producers[n.input[0]].op_type == "QuantizeLinear" for n in dequantized)


def test_onnx_reference_evaluator_agrees_with_onnxruntime(finished_run):
    """A second, independent ONNX implementation (onnx.reference) runs both files: 100 % top-1 agreement with
    onnxruntime in fp32, >= 99 % in int8, on validation images."""
    from onnx.reference import ReferenceEvaluator

    data = load_data(load_config(None, ["data.name=digits"]).data, seed=0)
    x = data.val.batch(range(100)).x.numpy()
    for kind, needed in (("fp32", 1.0), ("int8", 0.99)):
        path = finished_run / "export" / f"model.{kind}.onnx"
        reference = ReferenceEvaluator(onnx.load(path)).run(None, {"input": x})[0]
        runtime = OnnxModel(str(path))(x)
        assert (reference.argmax(1) == runtime.argmax(1)).mean() >= needed, kind


def test_metadata_says_how_to_preprocess_and_read_the_output(finished_run):
    meta = metadata_of(onnx.load(finished_run / "export" / "model.int8.onnx"))
    assert meta["layout"] == "NCHW" and meta["input_dtype"] == "float32" and meta["color"] == "L"
    assert meta["resize"] == {"shorter_side": 8, "height": 8, "width": 8, "interpolation": "bilinear",
                              "antialias": True, "crop": "center"}
    assert meta["output"].startswith("logits") and len(meta["preprocessing"]) == 6
    assert "divide by 255" in meta["preprocessing"][3] and "mean" in meta["preprocessing"][4]


def test_the_readme_snippet_classifies_an_image_from_the_file_alone(finished_run, tmp_path):
    import re
    import subprocess
    import sys

    readme = open(os.path.join(ROOT, "README.md")).read()
    snippet = re.search(r"<!-- deploy-snippet -->\n```python\n(.*?)```", readme, re.S).group(1)
    assert len(snippet.strip().splitlines()) <= 15
    paths, _ = write_val_pngs(tmp_path, count=3)
    model = finished_run / "export" / "model.int8.onnx"
    expected = [e["top"][0]["class"] for e in json.loads(invoke("predict", model, *paths, "--json").stdout)]
    got = []
    for path in paths:
        code = snippet.replace('"model.int8.onnx"', repr(str(model))).replace('"digit.png"', repr(path))
        got.append(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                   .stdout.strip())
    assert got == expected


def test_bench_compares_two_files_side_by_side(finished_run):
    fp32, int8 = (finished_run / "export" / f"model.{k}.onnx" for k in ("fp32", "int8"))
    result = invoke("bench", fp32, int8, "--batch", "1,8", "--threads", "1", "--repeats", "5")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()  # stderr may hold a note that the machine is busy
    assert "interleaved rounds" in lines[2] and len(lines) == 6
    assert all(("faster than" in line or "slower than" in line) for line in lines[4:])


def _int8_pair(tmp_path, name, shape, float_layers=()):
    from compress.quant import fx as quant

    torch.manual_seed(0)
    model = build_model(name, shape, 10).eval()
    example = torch.randn(2, *shape)
    export_onnx(model, example, tmp_path / "fp32.onnx", 21, {})
    prepared = quant.prepare(model, example, float_layers=float_layers)
    prepared.eval()
    with torch.no_grad():
        for _ in range(3):
            prepared(torch.randn(32, *shape))
    export_onnx(quant.convert(prepared), example, tmp_path / "int8.onnx", 21, {})
    return {k: str(tmp_path / f"{k}.onnx") for k in ("fp32", "int8")}


def test_a_layer_kept_float_stays_float_in_the_int8_file(tmp_path):
    paths = _int8_pair(tmp_path, "compact_cnn", (1, 28, 28), float_layers=["stem.0"])
    graph = onnx.load(paths["int8"]).graph
    first = next(n for n in graph.node if n.op_type == "Conv")
    weights = {i.name: i for i in graph.initializer}
    assert weights[first.input[1]].data_type == onnx.TensorProto.FLOAT  # the stem: float weights, no DQ
    assert any(i.data_type == onnx.TensorProto.INT8 for i in graph.initializer)


def _weighed(fp32=2.0, int8=1.0, ptq=None, fp32_vs_int8=(3, 2, 1.0), qat_vs_ptq=(2, 3, 1.0), ptq_kernels=True,
             float_layers=(), **config):
    """compress.quant.verdict.weigh on figures given by hand: latencies {kind: ms or (ms, [round ms...])} in the
    deciding cell (batch 64, 2 threads), pairs as (only_first, only_second, p)."""
    from compress.deploy.export_report import Paired, Parity, PostTraining
    from compress.quant.verdict import weigh
    from compress.run.config import ExportConfig

    def parity(acc):
        return Parity(0.0, 1.0, 0.0, 1.0, 1.0, 0.0, acc, acc, 400)

    def cells(ms):
        ms, rounds = ms if isinstance(ms, tuple) else (ms, [ms] * 5)
        return [{"batch": 1, "threads": 1, "ms": ms / 10}, {"batch": 64, "threads": 2, "ms": ms, "round_ms": rounds}]

    measured = {"fp32": parity(75.5), "int8": parity(75.25), "ptq": None,
                "pairs": {"fp32_vs_int8": Paired(*fp32_vs_int8), "fp32_vs_ptq": Paired(3, 3, 1.0)}}
    files, sizes = {"fp32": "model.fp32.onnx", "int8": "model.int8.onnx"}, {"fp32": 4_000_000, "int8": 1_000_000}
    tables = {"fp32": cells(fp32), "int8": cells(int8)}
    if ptq is not None:
        measured["ptq"] = PostTraining(75.5, Paired(*qat_vs_ptq), {"QLinearConv": 3} if ptq_kernels else {})
        files["ptq"], sizes["ptq"], tables["ptq"] = "model.ptq.onnx", 990_000, cells(ptq)
    return weigh(measured, tables, files, sizes, list(float_layers), ExportConfig(**config), "onnxruntime")


def test_the_verdict_names_the_file_to_deploy_and_says_why_in_one_sentence_with_the_figures():
    """int8 when it is min_int8_speedup times faster than fp32 in the table's deciding cell; else fp32, called the
    faster file only when int8 is really slower, with what int8 still offers (its size) and what to change."""
    fast, kind = _weighed(2.0, 1.0, min_int8_speedup=1.2)
    assert (fast.deploy, fast.file, fast.int8_faster, kind) == ("int8", "model.int8.onnx", True, "int8")
    assert fast.why == ("QAT int8 is 2.00x faster than fp32 (batch 64, 2 threads in onnxruntime: 1.00 ms against "
                        "fp32's 2.00 ms) and 4.0x smaller, at 75.25% validation accuracy against fp32's 75.50% (within "
                        "noise, McNemar p = 1)")
    assert [(c.kind, c.ms, c.size_bytes) for c in fast.candidates] == [("fp32", 2.0, 4_000_000),
                                                                        ("int8", 1.0, 1_000_000)]
    slow, _ = _weighed(1.0, 1.25, float_layers=["stem.0"])
    assert (slow.deploy, slow.file, slow.int8_faster) == ("fp32", "model.fp32.onnx", False)
    assert slow.why == ("QAT int8 is 1.25x slower than fp32 even with stem.0 kept in float (batch 64, 2 threads in "
                        "onnxruntime: 1.25 ms against fp32's 1.00 ms; needed 1x), so the fp32 file is the faster one "
                        "to deploy; the int8 file is still 4.0x smaller, if size matters more than speed, at 75.25% "
                        "validation accuracy against fp32's 75.50% (within noise, McNemar p = 1); to make int8 pay, "
                        "keep more layers in float (qat.float_layers) or choose a student with more channels per layer")
    short, _ = _weighed(1.1, 1.0, min_int8_speedup=1.2)
    assert short.deploy == "fp32" and short.why.startswith("QAT int8 is 1.10x faster than fp32 (batch 64, 2 threads "
                                                           "in onnxruntime: 1.00 ms against fp32's 1.10 ms; needed "
                                                           "1.2x), so the fp32 file is the one to deploy;")
    assert short.why.endswith("int8 is faster, by less than the 1.2x export.min_int8_speedup asks: lower it to "
                              "deploy the int8 file") and "to make int8 pay" not in short.why
    # int8 less accurate than fp32 beyond noise: said, with the way back to fp32
    lossy, _ = _weighed(2.0, 1.0, fp32_vs_int8=(40, 10, 0.0001))
    assert lossy.deploy == "int8" and ("(40 images right only with fp32, 10 only with QAT int8: beyond noise, McNemar "
                                       "p = 0.0001; deploy model.fp32.onnx instead if those images matter more than "
                                       "speed)") in lossy.why
    for v in (fast, slow, short, lossy):
        assert v.why.count(". ") == 0 and not v.why.endswith(".")  # one sentence: the report adds the full stop


def test_the_verdict_weighs_the_ptq_file_against_the_qat_file_on_accuracy_then_speed():
    """Of the two int8 files: the more accurate beyond noise; equally accurate, the PTQ file only when it is at
    least 1.1x faster in every interleaved round (was: the QAT file, without a word about a faster PTQ file)."""
    rounds = [0.80, 0.82, 0.79, 0.81, 0.80]
    faster, kind = _weighed(2.0, 1.0, ptq=(0.80, rounds))  # within noise (p = 1), 1.25x faster every round
    assert (faster.file, kind, faster.deploy) == ("model.ptq.onnx", "ptq", "int8")
    assert faster.why.startswith("PTQ int8 is as accurate as QAT int8 (within noise: 3 validation images right only "
                                 "with PTQ, 2 only with QAT, McNemar p = 1) and 1.25x faster than it, in every "
                                 "interleaved round; it is 2.50x faster than fp32 (batch 64, 2 threads in onnxruntime: "
                                 "0.80 ms against fp32's 2.00 ms)")
    assert [c.kind for c in faster.candidates] == ["fp32", "int8", "ptq"]
    once, kind = _weighed(2.0, 1.0, ptq=(0.80, [0.80, 0.80, 0.80, 0.80, 1.02]))  # one round says otherwise
    assert (once.file, kind) == ("model.int8.onnx", "int8")
    assert once.why.endswith("; PTQ int8 is as accurate (within noise: 3 validation images right only with PTQ, 2 "
                             "only with QAT, McNemar p = 1) but not faster than QAT int8 by 1.1x in every round "
                             "(1.25x faster)")
    alike, kind = _weighed(2.0, 1.0, ptq=1.02)
    assert kind == "int8" and "(1.02x slower)" in alike.why
    better, kind = _weighed(2.0, 1.0, ptq=1.1, qat_vs_ptq=(2, 161, 2e-45))  # more accurate beyond noise, slower
    assert kind == "ptq" and better.why.startswith("PTQ int8 is more accurate than QAT int8 beyond noise (161 "
                                                   "validation images right only with PTQ, 2 only with QAT, McNemar "
                                                   "p < 0.0001: QAT cost accuracy here, a lower qat.lr may let it keep "
                                                   "it); it is 1.82x faster than fp32")
    worse, kind = _weighed(2.0, 1.0, ptq=(0.5, [0.5] * 5), qat_vs_ptq=(161, 2, 2e-45))  # faster, less accurate
    assert kind == "int8" and worse.why.endswith("; PTQ int8 is less accurate than QAT int8 beyond noise (2 validation "
                                                 "images right only with PTQ, 161 only with QAT, McNemar p < 0.0001)")
    no_kernels, kind = _weighed(2.0, 1.0, ptq=(0.5, [0.5] * 5), qat_vs_ptq=(2, 161, 2e-45), ptq_kernels=False)
    assert kind == "int8" and "PTQ int8 runs no int8 kernel in onnxruntime" in no_kernels.why
    slow, kind = _weighed(1.0, 1.25, ptq=1.3, min_int8_speedup=1.0)  # neither int8 file pays: fp32, both named
    assert slow.file == "model.fp32.onnx" and "; of the two int8 files, PTQ int8 is as accurate" in slow.why


def test_the_reports_words_on_qat_against_ptq_follow_what_the_verdict_weighed():
    from compress.quant.verdict import beyond_noise

    m = {"qat_only_right": 2, "ptq_only_right": 161, "qat_vs_ptq_p": 2e-45, "val_images": 500}
    assert "so model.ptq.onnx is the int8 file the verdict weighed" in beyond_noise({**m, "int8_weighed":
                                                                                      "model.ptq.onnx"})
    assert "runs no int8 kernel in model.ptq.onnx, so the verdict kept the QAT file" in beyond_noise(
        {**m, "int8_weighed": "model.int8.onnx"})
    assert "model.ptq.onnx is the int8 file to try first" in beyond_noise(m)  # an export from before
    noise = {**m, "qat_only_right": 2, "ptq_only_right": 3, "qat_vs_ptq_p": 1.0}
    assert beyond_noise({**noise, "int8_weighed": "model.ptq.onnx"}).endswith(
        "equally accurate on this evidence; the verdict weighed model.ptq.onnx, the faster of the two")


def test_when_qat_cost_accuracy_the_verdict_deploys_the_post_training_quantized_file(run_copy, tiny_config):
    """QAT at a learning rate that wrecks the int8 model (the budget is off in the tiny config): onnxruntime's
    post-training quantization of the same float student is right on far more validation images, so the verdict
    weighs model.ptq.onnx against fp32, says why, and predict serves it."""
    result = invoke("run", "-c", tiny_config, "--run-dir", run_copy, "--stages", "qat,export", "--set", "qat.lr=0.5",
                    "--set", "qat.kd_weight=0")
    assert result.exit_code == 0, result.output
    export = json.loads((run_copy / "export" / "export.json").read_text())
    pair = export["ptq"]["vs_qat"]
    assert pair["p"] < 0.05 and pair["only_second"] > pair["only_first"], pair  # the setup: QAT lost, beyond noise
    assert export["speed"]["int8_file"] == "model.ptq.onnx"
    assert "threads: int8 (model.ptq.onnx) " in result.stderr  # the stage's summary line names the file timed
    verdict = export["verdict"]
    assert verdict["file"] == "model.ptq.onnx", verdict  # min_int8_speedup 0 in the tiny config: int8 wins on speed
    assert verdict["why"].startswith(f"PTQ int8 is more accurate than QAT int8 beyond noise ({pair['only_second']} "
                                     f"validation images right only with PTQ, {pair['only_first']} only with QAT")
    assert f"at {export['ptq']['onnx_acc']:.2f}% validation accuracy against fp32's" in verdict["why"]
    report = (run_copy / "report.md").read_text()
    assert "Deploy export/model.ptq.onnx: PTQ int8 is more accurate than QAT int8 beyond noise" in report
    assert "so model.ptq.onnx is the int8 file the verdict weighed against fp32" in report
    image = run_copy / "digit.png"
    Image.fromarray(np.full((8, 8), 128, dtype=np.uint8)).save(image)
    predicted = invoke("predict", run_copy, image)
    assert predicted.exit_code == 0 and "using model.ptq.onnx, as export recommends" in predicted.stderr


def test_an_int8_model_not_fast_enough_ends_in_a_verdict_for_the_fp32_file(tmp_path):
    """The fp32 verdict through the whole pipeline: export.min_int8_speedup 100 (no int8 file is 100x faster, so
    the outcome does not hang on how fast this machine is today; the KD tutorial's thin light_cnn at 3x32x32). The
    stage completes, both files verified and kept, the deciding cell measured twice before deciding (the table
    keeps the figures the verdict read), the verdict names the fp32 file with both latencies, predict uses it;
    with export.require_faster_int8 the same message fails the stage."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 16), ("val", 8)):
        for cls in ("a", "b"):
            (tmp_path / "img" / split / cls).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(
                    tmp_path / "img" / split / cls / f"{i}.png")
    run = tmp_path / "run"
    base = ["run", "--run-dir", run, "--set", "data.name=imagefolder", "--set", f"data.root={tmp_path / 'img'}",
            "--set", "model.teacher=light_cnn", "--set", "model.student=light_cnn", "--set", "teacher.epochs=1",
            "--set", "distill.epochs=1", "--set", "distill.baseline=false", "--set", "qat.epochs=1",
            "--set", "qat.max_accuracy_drop=100", "--set", "qat.float_layers=[]", "--set", "train.progress=false",
            "--set", "export.latency_repeats=3", "--set", "export.min_int8_speedup=100"]
    result = invoke(*base)
    assert result.exit_code == 0, result.output
    export = json.loads((run / "export" / "export.json").read_text())
    speed, verdict = export["speed"], export["verdict"]
    assert speed["speedup"] < 100 and len(speed["attempts"]) == 2 and verdict["deploy"] == "fp32"
    assert verdict["why"].startswith("QAT int8 is") and "than fp32 (batch 64, " in verdict["why"]
    assert f"{speed['int8_ms']:.2f} ms against fp32's {speed['fp32_ms']:.2f} ms; needed 100x)" in verdict["why"]
    assert [a["rounds"] for a in speed["attempts"]] == [5, 11]
    cells = {k: next(c for c in export["latency_ms"][k] if (c["batch"], c["threads"]) == (64, speed["threads"]))
             for k in ("fp32", "int8")}
    assert (cells["fp32"]["ms"], cells["int8"]["ms"]) == (speed["fp32_ms"], speed["int8_ms"])
    assert len(cells["fp32"]["round_ms"]) == 11  # the longer measurement is the table's cell too
    assert "x smaller, if size matters more than speed" in verdict["why"]
    assert f"Deploy export/model.fp32.onnx: {verdict['why']}" in (run / "report.md").read_text()
    for name in ("model.fp32.onnx", "model.int8.onnx", "model.ptq.onnx", "export.json"):
        assert (run / "export" / name).is_file()
    pair = export["ptq"]["vs_qat"]  # QAT against PTQ: the images only one of them gets right, and their weight
    assert pair["only_first"] + pair["only_second"] <= export["int8"]["samples"] and 0 <= pair["p"] <= 1
    assert f"{pair['only_first']} are right only with QAT and {pair['only_second']} only with PTQ" in (
        run / "report.md").read_text()
    image = next((tmp_path / "img" / "val" / "a").iterdir())
    predicted = invoke("predict", run, image)
    assert predicted.exit_code == 0 and "using model.fp32.onnx, as export recommends" in predicted.stderr
    strict = invoke(*base, "--set", "export.require_faster_int8=true")
    assert strict.exit_code == 1, strict.output
    errors = [line for line in strict.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: export: QAT int8 is")
    assert "needed 100x), so the fp32" in errors[0]
    assert "export.require_faster_int8 is true" in errors[0]
    for name in ("model.fp32.onnx", "model.int8.onnx", "export.json"):
        assert (run / "export" / name).is_file()


def test_torch_int8_matches_exact_arithmetic_on_a_wide_depthwise_convolution():
    """Full-range activations on x86: fbgemm's depthwise kernel was up to 70 steps off exact arithmetic for
    144 channels (what made torch int8 and onnxruntime disagree on mobilenet_v2); the engine quant.prepare
    picks must stay within one rounding step."""
    import torch.nn.functional as F
    from torch import nn

    from compress.quant import fx as quant

    torch.manual_seed(0)
    channels = 144
    model = nn.Sequential(nn.Conv2d(channels, channels, 1), nn.Conv2d(channels, channels, 3, padding=1,
                                                                      groups=channels, bias=False))
    x = torch.randn(8, channels, 8, 8)
    prepared = quant.prepare(model, x, "x86", "full", True).eval()
    with torch.no_grad():
        prepared(x)
    int8 = quant.convert(prepared)
    seen = {}
    depthwise = int8.get_submodule("1")
    depthwise.register_forward_hook(lambda module, args, out: seen.update(x=args[0], out=out))
    with torch.no_grad():
        int8(x)
        exact = F.conv2d(seen["x"].dequantize(), depthwise.weight().dequantize(), depthwise.bias(), 1, 1, 1, channels)
    expected = torch.quantize_per_tensor(exact, depthwise.scale, depthwise.zero_point, torch.quint8).int_repr().int()
    assert (seen["out"].int_repr().int() - expected).abs().max().item() <= 1, torch.backends.quantized.engine


def test_int8_agreement_counts_near_ties_within_two_output_steps():
    from compress.quant.verify import compare

    torch_logits = torch.tensor([[1.00, 0.95, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, 3.0]])
    onnx_logits = np.array([[0.9, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 3.0]], dtype=np.float32)
    loader = [(torch.zeros(3, 1), torch.tensor([0, 0, 2]))]

    class Fixed(torch.nn.Module):
        def forward(self, x):
            return torch_logits

    report = compare(Fixed(), lambda x: onnx_logits, loader, tie=0.1)
    # image 0 is a near-tie (0.95 vs 1.00): agreeing within the tie, not exactly; image 1 is a real disagreement
    assert report["top1_agreement"] == pytest.approx(1 / 3) and report["top1_within_tie"] == pytest.approx(2 / 3)
    assert compare(Fixed(), lambda x: onnx_logits, loader)["top1_within_tie"] == pytest.approx(1 / 3)
    # logits left float: two steps of 8-bit resolution over their range (3.0 / 255 * 2 = 0.0235) - too fine here
    assert compare(Fixed(), lambda x: onnx_logits, loader, tie=None)["top1_within_tie"] == pytest.approx(1 / 3)


def test_qat_against_ptq_counts_the_images_only_one_gets_right_and_tests_them_exactly():
    """McNemar's exact test by hand: with n images only one file gets right, and k the fewer of them,
    p = 2 * sum(C(n, i), i <= k) / 2^n, capped at 1."""
    from compress.quant.verify import onnx_correct
    from compress.training.paired import paired

    qat = np.array([True] * 10 + [True, False, False, False, False, False, False, False, False])
    ptq = np.array([True] * 10 + [False, True, True, True, True, True, True, True, True])
    assert paired(qat, ptq) == {"only_first": 1, "only_second": 8, "p": 0.03906}  # 2 * (1 + 9) / 512
    assert paired(ptq, ptq) == {"only_first": 0, "only_second": 0, "p": 1.0}
    assert paired(qat[:12], ptq[:12])["p"] == 1.0  # one each way: 2 * (1 + 2) / 4, capped
    assert paired(np.zeros(6, bool), np.ones(6, bool))["p"] == 0.03125  # 2 / 64
    many = np.arange(45000)
    assert 0 < paired(many < 20000, many >= 20000)["p"] < 1e-100  # 20,000 vs 25,000: milliseconds, not minutes
    loader = [(torch.zeros(2, 1), torch.tensor([0, 1])), (torch.zeros(1, 1), torch.tensor([2]))]
    logits = iter([np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), np.array([[0.0, 0.0, 1.0]])])
    assert onnx_correct(lambda x: next(logits), loader).tolist() == [True, False, True]


def test_fp32_parity_scales_with_the_logits():
    """float32 rounds to a share of the number: logits in the millions (a student whose activations blew up) differ
    by tens between two correct implementations, and that is not an exporter difference; logits near 1 keep the
    absolute limit."""
    import dataclasses
    from types import SimpleNamespace

    from compress.deploy.export_report import Parity
    from compress.quant.verify import checks, compare

    loader = [(torch.zeros(2, 1), torch.tensor([0, 1]))]

    def parity(torch_logits, onnx_logits):
        class Fixed(torch.nn.Module):
            def forward(self, x):
                return torch.tensor(torch_logits)

        fp32 = compare(Fixed(), lambda x: np.array(onnx_logits, dtype=np.float32), loader)
        fp32.pop("correct")
        parity = Parity(**fp32)
        e = SimpleNamespace(fp32_max_abs_diff=1e-3, fp32_min_agreement=1.0, int8_min_agreement=0.99)
        found = checks(parity, dataclasses.replace(parity, top1_within_tie=1.0), {"QLinearConv": 1}, e)["fp32_parity"]
        return fp32, {"ok": found.ok, "detail": found.detail}

    fp32, check = parity([[1.2e6, -3e5], [-2e5, 9e5]], [[1.2e6 + 28.5, -3e5], [-2e5, 9e5 - 4]])
    assert fp32["max_abs_diff"] == pytest.approx(28.5) and fp32["max_scaled_diff"] == pytest.approx(28.5 / 1.2e6)
    assert check["ok"] and "logits up to 1.2e+06" in check["detail"]
    fp32, check = parity([[0.5, -0.25], [0.1, 0.9]], [[0.5, -0.25], [0.1, 0.9 + 2e-3]])  # the absolute limit
    assert not check["ok"] and fp32["max_scaled_diff"] == pytest.approx(2e-3, rel=1e-3)
    assert "export.fp32_max_abs_diff=0.003" in check["detail"]
    fp32, check = parity([[20.0, -5.0], [1.0, 3.0]], [[20.01, -5.0], [1.0, 3.0]])  # 0.01 of 20: 5e-4, within
    assert check["ok"] and fp32["max_scaled_diff"] == pytest.approx(5e-4, rel=1e-2)
    fp32, check = parity([[20.0, -5.0], [1.0, 3.0]], [[float("nan"), -5.0], [1.0, 3.0]])  # a broken float student
    assert not check["ok"] and "the logits are not finite (NaN or inf)" in check["detail"]


def test_relu6_between_int8_layers_clamps_the_integers(tmp_path):
    """ReLU6 (mobilenets) exports as Q -> DQ -> Clip -> Q with one set of parameters; it must ship as a clamp on
    the uint8 values (Q -> Clip), which computes the same numbers without three float passes."""
    from onnx.reference import ReferenceEvaluator
    from torch import nn

    from compress.quant import fx as quant
    from compress.quant.verify import output_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)).eval()
    x = torch.randn(16, 3, 12, 12) * 3
    prepared = quant.prepare(model, x[:2]).eval()
    with torch.no_grad():
        prepared(x)
    int8 = quant.convert(prepared)
    path = tmp_path / "int8.onnx"
    export_onnx(int8, x[:2], path, 21, {})
    graph = onnx.load(path).graph
    producers = {out: node for node in graph.node for out in node.output}
    clips = [n for n in graph.node if n.op_type == "Clip"]
    assert len(clips) == 2 and all(producers[c.input[0]].op_type == "QuantizeLinear" for c in clips)
    runtime = OnnxModel(str(path), require_metadata=False)(x.numpy())
    reference = ReferenceEvaluator(onnx.load(path)).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        expected = int8(x).numpy()
    assert np.array_equal(runtime, reference)
    assert output_step(str(path)) is not None
    assert np.abs(runtime - expected).max() <= 2 * output_step(str(path))


def test_the_latency_table_times_the_files_in_turns():
    """The report's latency table: each file gets its timed runs in rounds that alternate, so a busy neighbour
    slows all of them alike (was: one file after the other - the same PTQ and QAT files read 2.09 and 4.99 ms on a
    loaded machine), and a file runs several times in a row each round (was: 6 runs a turn, whose first ones shared
    the cores with the previous session's spinning threads: fp32 4.4 ms in the table, 1.9 ms alone)."""
    from compress.deploy.timing import compare_latency

    calls = []
    models = {name: (lambda x, name=name: calls.append(name)) for name in ("fp32", "int8", "ptq")}
    times = compare_latency(models, None, rounds=2, budget_s=1.0, warmup=1, most=4)
    assert set(times) == {"fp32", "int8", "ptq"} and all(t["runs"] == 8 and t["median_ms"] >= 0
                                                          for t in times.values())
    assert calls == ["fp32"] * 2 + ["int8"] * 2 + ["ptq"] * 2 + ["fp32"] * 4 + ["int8"] * 4 + ["ptq"] * 4 + \
        ["ptq"] * 4 + ["int8"] * 4 + ["fp32"] * 4  # warm-up and one untimed run each; round 1 in order, 2 reversed


def test_latency_tables_of_several_files_have_a_row_per_cell(finished_run):
    from compress.deploy.latency import latency_tables

    export = finished_run / "export"
    paths = {k: export / f"model.{k}.onnx" for k in ("fp32", "int8", "ptq")}
    tables = latency_tables(paths, (1, 4), threads=(1,), repeats=3, warmup=1)
    assert set(tables) == set(paths)
    assert all([(r["batch"], r["threads"]) for r in rows] == [(1, 1), (4, 1)] and all(r["ms"] > 0 for r in rows)
               for rows in tables.values())
