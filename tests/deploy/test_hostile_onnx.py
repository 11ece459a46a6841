"""ONNX files built to break predict, eval and bench (compress.deploy.onnx_model): each is refused in one sentence
that names the file, exit code 2, with no traceback and no onnxruntime log on the terminal. The files are small
graphs written with the onnx package, carrying the metadata an export writes."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from conftest import compress_subprocess, invoke

META = {"class_names": [str(i) for i in range(10)], "input_shape": [1, 8, 8], "channel_order": "gray",
        "mean": [0.5], "std": [0.25]}
BENCH = ("--threads", "1", "--repeats", "2", "--warmup", "0")


def classifier(path, batch="N", extra_input=False, bias=0.0, reshape=64, meta=None, classes=10, weight=None):
    """An 8x8 grayscale, 10-class ONNX file: reshape to (-1, `reshape`), back to (-1, 64), a MatMul and a bias of
    `bias` (NaN or inf for non-finite scores); a `reshape` that does not divide 64 fails in onnxruntime only when
    run. `batch` is the inputs' first dimension, `meta` replaces compress.* values (raw strings); `weight` replaces
    the random MatMul weights (zeros and a `bias` array: the same scores for every image)."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 1, 8, 8])
    inputs = [x] + ([helper.make_tensor_value_info("extra", TensorProto.FLOAT, [batch, 3])] if extra_input else [])
    weights = [numpy_helper.from_array(np.array([-1, reshape], np.int64), "to"),
               numpy_helper.from_array(np.array([-1, 64], np.int64), "back"),
               numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, classes)).astype(np.float32)
                                      if weight is None else np.full((64, classes), weight, np.float32), "w"),
               numpy_helper.from_array(np.full((classes,), bias, np.float32), "b")]
    nodes = [helper.make_node("Reshape", ["input", "to"], ["r"]), helper.make_node("Reshape", ["r", "back"], ["flat"]),
             helper.make_node("MatMul", ["flat", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["logits"])]
    graph = helper.make_graph(nodes, "classifier", inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    names = {"class_names": json.dumps([str(i) for i in range(classes)])}
    for key, value in {**{k: json.dumps(v) for k, v in META.items()}, **names, **(meta or {})}.items():
        prop = model.metadata_props.add()
        prop.key, prop.value = f"compress.{key}", value
    onnx.save(model, path)
    return path


@pytest.fixture
def images(tmp_path):
    """Two labelled 8x8 images, tmp_path/val/<class>/<image>: (the two files, their folder tree)."""
    paths = []
    for label, grey in (("0", 40), ("1", 200)):
        (tmp_path / "val" / label).mkdir(parents=True)
        paths.append(tmp_path / "val" / label / "a.png")
        Image.new("L", (8, 8), grey).save(paths[-1])
    return paths, tmp_path / "val"


def refused(result, *words):
    assert result.exit_code == 2, result.output
    assert result.stderr.count("error:") == 1, result.stderr
    for w in words:
        assert w in result.stderr, result.stderr
    assert "unexpected" not in result.output and "Traceback" not in result.output, result.output


def test_deeply_nested_metadata_is_refused_like_other_bad_metadata(tmp_path, images):
    """A JSON value nested 100,000 deep in the metadata is malformed metadata, not a RecursionError."""
    paths, tree = images
    model = classifier(tmp_path / "deep.onnx", meta={"class_names": "[" * 100_000 + "]" * 100_000})
    for args in (["predict", model, *paths], ["eval", model, tree]):
        refused(invoke(*args), f"'{model}' metadata compress.class_names", "re-export the model")


def test_a_second_graph_input_is_refused_up_front(tmp_path, images):
    paths, tree = images
    model = classifier(tmp_path / "extra.onnx", extra_input=True)
    for args in (["predict", model, *paths], ["eval", model, tree], ["bench", model, "--batch", "1", *BENCH]):
        refused(invoke(*args), f"'{model}' has 2 inputs (input, extra); compress feeds one image batch")


def test_a_fixed_batch_of_one_is_run_an_image_at_a_time_and_refused_by_bench_at_larger_batches(tmp_path, images):
    paths, tree = images
    model = classifier(tmp_path / "fixed.onnx", batch=1)
    dynamic = classifier(tmp_path / "dynamic.onnx")
    result = invoke("predict", model, *paths)
    assert result.exit_code == 0, result.output
    assert result.stdout == invoke("predict", dynamic, *paths).stdout.replace("dynamic.onnx", "fixed.onnx")
    result = invoke("eval", model, tree, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["images"] == 2, result.output
    refused(invoke("bench", model, "--batch", "1,8", *BENCH),
            f"'{model}' takes a fixed batch of 1 image, but it is timed at batch sizes 1, 8; export it with a "
            "dynamic batch dimension")
    assert invoke("bench", model, "--batch", "1", *BENCH).exit_code == 0


def test_a_fixed_batch_of_several_is_refused_by_predict_and_eval(tmp_path, images):
    paths, tree = images
    model = classifier(tmp_path / "fixed8.onnx", batch=8)
    for args in (["predict", model, *paths], ["eval", model, tree]):
        refused(invoke(*args), f"'{model}' takes a fixed batch of 8 images, but compress feeds batches of any size; "
                               "export it with a dynamic batch dimension")


def test_a_node_that_fails_at_run_time_is_one_sentence_without_onnxruntime_s_log(tmp_path, images):
    """onnxruntime loads the file and fails only when a node runs: its own coloured log line stays off the
    terminal, and its message comes as one sentence naming the file."""
    paths, tree = images
    model = classifier(tmp_path / "fails.onnx", reshape=63)
    proc = compress_subprocess("predict", model, *paths, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: onnxruntime failed to run '{model}': "), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "\x1b" not in proc.stderr, proc.stderr
    for args in (["eval", model, tree], ["bench", model, "--batch", "1", *BENCH]):
        refused(invoke(*args), f"onnxruntime failed to run '{model}': ")


@pytest.mark.parametrize("bias", [float("nan"), float("inf")])
def test_non_finite_scores_are_refused(tmp_path, images, bias):
    paths, tree = images
    model = classifier(tmp_path / "nan.onnx", bias=bias)
    result = invoke("predict", model, *paths)
    refused(result, f"'{model}' gives non-finite scores (NaN or inf) for '{paths[0]}'; re-export the model")
    assert "RuntimeWarning" not in result.output and "nan%" not in result.output, result.output
    refused(invoke("eval", model, tree),
            f"'{model}' gives non-finite scores (NaN or inf) for the validation images; re-export the model")


def _with_tail(source, path, nodes, output, weights=()):
    """The classifier `source` with `nodes` after its logits and `output` (a ValueInfo) as its only output."""
    model = onnx.load(source)
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(weights)
    del model.graph.output[:]
    model.graph.output.append(output)
    onnx.save(model, path)
    return path


def test_a_graph_that_is_not_a_classifier_of_float_scores_is_refused_before_an_image_is_read(tmp_path, images):
    """Scores of rank 1 or 3, booleans or text, and a Loop (which runs as long as its inputs say, in a native call
    Ctrl-C cannot stop) are no file export writes: one sentence each for predict and eval (and bench, for the
    Loop), not 'unexpected AxisError' or a wait without end."""
    paths, tree = images
    base = classifier(tmp_path / "base.onnx")
    one = numpy_helper.from_array(np.array(1, np.int64), "one")
    yes = numpy_helper.from_array(np.array(True), "yes")
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Identity", ["x_in"], ["x_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("x_in", TensorProto.FLOAT, ["N", 10])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, ["N", 10])])
    cases = {
        "rank1": ([helper.make_node("ReduceMax", ["logits"], ["top"], keepdims=0, axes=[1])],
                  helper.make_tensor_value_info("top", TensorProto.FLOAT, ["N"]), [], "of shape ['N']"),
        "bool": ([helper.make_node("Greater", ["logits", "b"], ["above"])],
                 helper.make_tensor_value_info("above", TensorProto.BOOL, ["N", 10]), [], "outputs tensor(bool)"),
        "loop": ([helper.make_node("Loop", ["one", "yes", "logits"], ["looped"], body=body)],
                 helper.make_tensor_value_info("looped", TensorProto.FLOAT, ["N", 10]), [one, yes],
                 "holds control flow (Loop)"),
    }
    for name, (nodes, output, weights, words) in cases.items():
        model = _with_tail(base, tmp_path / f"{name}.onnx", nodes, output, weights)
        timed = [["bench", model, *BENCH]] if name == "loop" else []  # bench times any graph but a loop
        for args in (["predict", model, *paths], ["eval", model, tree], *timed):
            refused(invoke(*args), f"'{model}'", words, "re-export the model")


def test_eval_of_a_model_of_thousands_of_classes_prints_no_matrix_of_millions_of_cells(tmp_path, images):
    """A 2,000-class file scored on two class folders: the per-class lines, the matrix left to --json (it was
    printed whole: 601 MB for 10,000 classes), and --png refused before any image is read."""
    _, tree = images
    model = classifier(tmp_path / "many.onnx", classes=2000)
    scored = invoke("eval", model, tree)
    assert scored.exit_code == 0, scored.output
    assert "confusion matrix: 2,000 x 2,000 classes, in --json" in scored.stdout and len(scored.stdout) < 100_000
    refused(invoke("eval", model, tree, "--png", tmp_path / "c.png"),
            "--png draws the confusion matrix of up to 100 classes", "has 2,000")
    assert not (tmp_path / "c.png").exists()


def test_evals_json_top5_is_null_at_5_classes_or_fewer(tmp_path, images):
    """With 5 classes or fewer every image is in its top 5: 100 % says nothing, so the JSON says null."""
    _, tree = images
    few = json.loads(invoke("eval", classifier(tmp_path / "three.onnx", classes=3), tree, "--json").stdout)
    ten = json.loads(invoke("eval", classifier(tmp_path / "ten.onnx"), tree, "--json").stdout)
    assert few["top5"] is None and isinstance(ten["top5"], float)


@pytest.mark.parametrize("key", ["mean", "std"])
def test_bench_times_a_file_whose_normalisation_is_not_numbers_on_plain_pixels(tmp_path, images, key):
    """bench only needs inputs of the file's shape: a compress.mean/std of one string per channel is not used (it was
    an unexpected TypeError/ValueError); predict and eval, which need it, refuse it in one sentence."""
    path = classifier(tmp_path / "m.onnx", meta={key: '["a"]'})
    result = invoke("bench", path, *BENCH)
    assert result.exit_code == 0, result.output
    assert "unexpected" not in result.output
    refused(invoke("predict", path, images[0][0]), f"metadata compress.{key} must hold 1 finite number(s), one per "
                                                   "channel; got ['a']; re-export the model")


def test_predict_and_eval_break_a_tie_for_top_1_alike(tmp_path):
    """An int8 file's class scores come in steps, so two classes can tie exactly; predict's first class is the
    one eval counts (the lower class index, as argmax takes), never the other one. numpy's default sort put
    class 7 first for these scores."""
    bias = np.array([0.35, 0.90, 0.09, -0.74, -0.92, 1.90, 0.22, 1.90, -0.21, -0.16], np.float32)  # 5 and 7 tie
    model = classifier(tmp_path / "tied.onnx", weight=0.0, bias=bias)
    image = tmp_path / "val" / "5" / "a.png"
    image.parent.mkdir(parents=True)
    Image.new("L", (8, 8), 90).save(image)
    result = invoke("predict", model, image, "--top-k", "3", "--json")
    assert result.exit_code == 0, result.output
    top = json.loads(result.stdout)[0]["top"]
    assert [t["class"] for t in top] == ["5", "7", "1"], top
    evaluated = invoke("eval", model, tmp_path / "val", "--json")
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.stdout)["per_class"]["5"][0] == 100.0  # (accuracy, images): eval picked class 5
