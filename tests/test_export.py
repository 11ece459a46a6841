import json

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from compress.config import load_config
from compress.data import load_data
from compress.deploy import OnnxModel, metadata_of, optimized_op_types
from compress.errors import InputError
from compress.models import build_model
from compress.to_onnx import export_onnx
from conftest import compress_subprocess, invoke


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
    x, _, _ = data.val.batch(range(count))
    return paths, x


def test_predict_gives_the_labels_pytorch_gives(finished_run, tmp_path):
    paths, x = write_val_pngs(tmp_path)
    model = build_model("compact_cnn", (1, 8, 8), 10).eval()
    from compress.checkpoint import load_weights
    load_weights(model, finished_run / "distill" / "model.safetensors")
    with torch.no_grad():
        expected = [str(i) for i in model(x).argmax(1).tolist()]
    result = invoke("predict", finished_run / "export" / "model.fp32.onnx", *paths, "--json", "--top-k", "2")
    assert result.exit_code == 0, result.output
    got = [entry["top"][0]["class"] for entry in json.loads(result.stdout)]
    assert got == expected


def test_predict_and_bench_from_the_installed_script(finished_run, tmp_path):
    paths, _ = write_val_pngs(tmp_path, count=2)
    model = finished_run / "export" / "model.int8.onnx"
    proc = compress_subprocess("predict", model, *paths)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("%") == 6  # two images, top-3 each
    proc = compress_subprocess("bench", model, "--batch", "1,4", "--threads", "1", "--repeats", "3")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 4  # title, header, two rows


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
    ]
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
