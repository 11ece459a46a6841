"""The latency-aware choice of layers kept in float (compress.quant.mixed_precision.choose_float_layers), driven
by a timer whose times come from a cost model instead of onnxruntime: each decision rule is checked alone."""

import pytest

from compress.models.registry import build_model
from compress.quant.mixed_precision import candidate_groups, choose_float_layers


class CostTimer:
    """`compare(*choices)`: the time of each float-layer choice as the sum of per-layer costs (a layer in the
    choice costs its float time, else its int8 time; ("<all>",) is the fp32 model). Records what it was asked."""

    def __init__(self, float_ms, int8_ms):
        self.float_ms, self.int8_ms, self.asked = float_ms, int8_ms, []

    def compare(self, *choices):
        self.asked.append(choices)
        out = []
        for choice in choices:
            if choice == ("<all>",):
                out.append(sum(self.float_ms.values()))
            else:
                out.append(sum(self.float_ms[n] if n in choice else self.int8_ms[n] for n in self.float_ms))
        return out


def compact():
    model = build_model("compact_cnn", (3, 32, 32), 10)
    groups, layers = candidate_groups(model)
    assert layers == ["stem.0", "block1.0.0", "block2.0", "classifier"]
    assert [label for label, _ in groups] == ["stem", "classifier"]
    return model


def test_everything_int8_when_every_layer_is_faster_in_int8():
    timer = CostTimer({"stem.0": 2, "block1.0.0": 4, "block2.0": 4, "classifier": 1},
                      {"stem.0": 1, "block1.0.0": 1, "block2.0": 1, "classifier": 0.5})
    layers, figures = choose_float_layers(timer, compact())
    assert layers == [] and figures["fp32_ms"] == 11 and figures["all_int8_ms"] == 3.5
    assert [t["kept_float"] for t in figures["tried"]] == [False, False]


def test_a_stem_that_is_slower_in_int8_stays_float_and_the_prefix_grows_while_it_pays():
    timer = CostTimer({"stem.0": 1, "block1.0.0": 1, "block2.0": 4, "classifier": 1},
                      {"stem.0": 3, "block1.0.0": 2, "block2.0": 1, "classifier": 1})
    layers, figures = choose_float_layers(timer, compact())
    # stem float saves 2 ms, block1 float saves 1 more; block2 float would cost 3 more: the prefix stops there
    assert layers == ["block1.0.0", "stem.0"]
    assert [t["float"] for t in figures["tried"]] == ["stem", "prefix up to block1.0.0", "prefix up to block2.0",
                                                      "classifier"]
    assert figures["chosen_ms"] == 1 + 1 + 1 + 1


def test_a_group_must_save_more_than_the_margin_to_stay_float():
    """Keeping a layer in float that saves 2 % is noise, not a decision: the margin (5 %) keeps it int8."""
    int8 = {"stem.0": 1, "block1.0.0": 1, "block2.0": 1, "classifier": 1.0}
    timer = CostTimer({"stem.0": 9, "block1.0.0": 9, "block2.0": 9, "classifier": 0.92}, int8)
    assert choose_float_layers(timer, compact())[0] == []
    timer = CostTimer({"stem.0": 9, "block1.0.0": 9, "block2.0": 9, "classifier": 0.7}, int8)
    assert choose_float_layers(timer, compact())[0] == ["classifier"]


def test_depthwise_convolutions_are_tried_as_one_group():
    model = build_model("mobilenet_v2", (3, 32, 32), 10)
    groups, layers = candidate_groups(model)
    depthwise = dict(groups)["depthwise convolutions"]
    assert len(depthwise) == 17 and all(name in layers for name in depthwise)
    float_ms = {n: (0.1 if n in depthwise else 5.0) for n in layers}
    int8_ms = {n: (0.5 if n in depthwise else 1.0) for n in layers}
    chosen, figures = choose_float_layers(CostTimer(float_ms, int8_ms), model)
    assert chosen == sorted(depthwise) and figures["tried"][-1]["float"] == "depthwise convolutions"


def test_at_least_one_layer_stays_int8_even_when_every_layer_is_faster_in_float():
    """A two-layer model (a convolution and a classifier) both faster in float: keeping both float would leave an
    'int8' file without an int8 layer, which export refuses - so the last group is not tried, and says why."""
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    timer = CostTimer({"0": 1, "4": 1}, {"0": 3, "4": 3})
    chosen, figures = choose_float_layers(timer, model)
    assert chosen == ["0"]
    assert figures["tried"][-1] == {"float": "classifier", "layers": ["4"], "kept_float": False,
                                    "skipped": "it would leave no layer in int8"}
    assert len(timer.asked) == 2  # fp32 vs all-int8, then the stem: the classifier was never timed


def test_a_stop_request_is_honoured_between_candidates():
    calls = []

    def stop():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    timer = CostTimer({"stem.0": 2, "block1.0.0": 4, "block2.0": 4, "classifier": 1},
                      {"stem.0": 1, "block1.0.0": 1, "block2.0": 1, "classifier": 0.5})
    with pytest.raises(KeyboardInterrupt):  # the request reaches the caller: the stage stops, not just the choice
        choose_float_layers(timer, compact(), stop=stop)
    assert len(timer.asked) == 2  # fp32 vs all-int8, then the stem; stopped before the classifier


@pytest.mark.e2e
def test_the_real_timer_builds_times_and_chooses_among_a_depthwise_models_int8_candidates():
    """The same greedy choice driven by the real Timer (prepare, calibrate, convert, ONNX export, onnxruntime),
    on a tiny model with a stem, a depthwise and a pointwise convolution and a classifier: every candidate
    group is built and timed, the figures are real times, and what is kept float is one of the groups."""
    import onnx
    import torch
    from torch import nn

    from compress.quant.mixed_precision import Timer
    from compress.run.config import load_config

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                          nn.ReLU(), nn.Conv2d(8, 16, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 4)).eval()
    groups, _ = candidate_groups(model)
    assert groups == [("stem", ["0"]), ("classifier", ["8"]), ("depthwise convolutions", ["2"])]
    images = torch.randn(16, 3, 16, 16)
    timer = Timer(model, list(images.split(8)), images[:8], load_config(None).qat, threads=1)
    try:
        chosen, figures = choose_float_layers(timer, model)
        # each candidate file keeps exactly its float layers float: the first convolution's weights are fp32
        # in the stem trial, int8 (behind a DequantizeLinear, not an initializer) with every layer int8
        first_conv_float = {}
        for key, session in timer.sessions.items():
            graph = onnx.load(session.path).graph
            weights = {i.name: i.data_type for i in graph.initializer}
            first = next(n for n in graph.node if n.op_type == "Conv")
            first_conv_float[key] = weights.get(first.input[1]) == onnx.TensorProto.FLOAT
    finally:
        timer.close()
    assert first_conv_float[("<all>",)] and first_conv_float[("0",)] and not first_conv_float[()]
    assert [t["float"] for t in figures["tried"]][:1] == ["stem"] and len(figures["tried"]) >= 3
    assert figures["fp32_ms"] > 0 and figures["all_int8_ms"] > 0 and figures["chosen_ms"] > 0
    assert set(chosen) <= {"0", "2", "4", "8"}  # the stem may grow into a float prefix (layer "2", then "4")
    # fp32, all int8 and at least one trial were each exported and run in onnxruntime
    assert {("<all>",), ()} < set(timer.sessions)


def test_a_model_whose_int8_graph_does_not_export_is_refused_before_training_without_a_graph_dump(capfd):
    """A batch norm that follows no convolution (DenseNet's BN-ReLU-Conv order) becomes quantized::batch_norm2d_relu,
    which the ONNX exporter does not know: the all-int8 candidate fails, so the choice raises Unexportable (the
    qat stage stops there, before training, with one sentence) - and the exporter's thousands-of-lines graph dump
    does not reach stdout."""
    import torch
    from torch import nn

    from compress.quant.mixed_precision import Timer, Unexportable
    from compress.run.config import load_config

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)).eval()
    images = torch.randn(16, 3, 16, 16)
    timer = Timer(model, list(images.split(8)), images[:8], load_config(None).qat, threads=1)
    try:
        with pytest.raises(Unexportable, match="batch_norm2d_relu"):
            choose_float_layers(timer, model)
    finally:
        timer.close()
    assert "Torch IR graph" not in capfd.readouterr().out
