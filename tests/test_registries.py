"""Each extension point is one registry, and everything a user sees derives from it: the config's choices, its
reference, the log's words and the docs. A loss added to a registry is a loss the product trains with."""

import dataclasses
import os
import typing

import pytest
import torch

import stages
from compress import cli
from compress.data.registry import DATASETS
from compress.distill.feature_losses import FEATURE_LOSSES
from compress.distill.logit_losses import LOGIT_LOSSES
from compress.distill.objective import describe_loss, make_loss
from compress.models.registry import DESCRIPTIONS, MODELS, SOURCES, source_of
from compress.run import config
from compress.run.config import Config
from compress.run.contract import Code, Images
from conftest import ROOT, invoke


def test_the_logit_losses_registry_is_the_configs_choices_its_reference_and_its_paper_defaults():
    choices = typing.get_args(config.KDConfig.__dataclass_fields__["method"].type)
    assert choices == tuple(LOGIT_LOSSES)
    reference = invoke("config", "--reference").output
    row = next(line for line in reference.splitlines() if line.startswith("| `distill.kd.method`"))
    assert all(name in row for name in LOGIT_LOSSES) and all(loss.summary in row for loss in LOGIT_LOSSES.values())
    for name, loss in LOGIT_LOSSES.items():
        assert set(loss.paper) == {"temperature", "weight", "ce_weight"}, f"LOGIT_LOSSES['{name}'].paper"
        kd = config.KDConfig(method=name)
        assert (kd.resolved_temperature, kd.resolved_weight) == (loss.paper["temperature"], loss.paper["weight"])
        assert not loss.params or dataclasses.is_dataclass(getattr(kd, loss.params))  # its own config section


def test_default_yaml_names_no_registered_choice_a_new_entry_would_leave_out():
    """configs/default.yaml, the file users copy, points to the generated lists instead of copying them: a loss or
    dataset added to its registry is not left out of a list there."""
    text = open(os.path.join(ROOT, "configs", "default.yaml")).read()
    assert not any(" | ".join(names) in text for names in (LOGIT_LOSSES, DATASETS))


def test_every_feature_loss_has_its_config_section():
    for name in FEATURE_LOSSES:
        section = config.DistillConfig.__dataclass_fields__[name].default_factory()
        assert {"weight", "teacher_layer", "student_layer"} <= {f.name for f in dataclasses.fields(section)}


def test_model_and_dataset_registries_are_what_compress_models_lists():
    listed = invoke("models").output
    assert set(MODELS) == set(DESCRIPTIONS)
    assert all(f"  {name} " in listed for name in MODELS)
    assert all(source.syntax in listed for key, source in SOURCES.items() if key != "registry")
    datasets = listed.split("datasets (data.name):")[1]
    assert all(f"  {name} " in datasets and DATASETS[name].description in datasets for name in DATASETS)
    assert tuple(DATASETS) == config.DATASET_NAMES
    reference_row = next(line for line in invoke("config", "--reference").output.splitlines()
                         if line.startswith("| `data.name`"))
    assert all(f"{name}: {dataset.description}" in reference_row for name, dataset in DATASETS.items())
    for key, source in SOURCES.items():
        assert source_of(source.example) is source, f"SOURCES['{key}'] does not read its own example name"


def test_a_model_source_added_to_the_registry_reads_its_names_before_user_code(monkeypatch):
    """A new source appended to SOURCES (after `<module>:<function>`, which reads any name with a colon) is still
    asked first; the config takes its names, the model builds, and no user-code digest is made for it."""
    from compress.models.registry import Source, build_model
    from compress.run.state import _digests

    monkeypatch.setitem(SOURCES, "zoo", Source("zoo:<name>", "a model zoo; a test", "zoo:tiny-net/v2",
                                               lambda n: n.startswith("zoo:"),
                                               lambda n, c, s, k: torch.nn.Sequential(torch.nn.Flatten(),
                                                                                      torch.nn.LazyLinear(k)),
                                               lambda n: None))
    assert source_of("zoo:tiny-net/v2") is SOURCES["zoo"] and source_of("mymodels:tiny") is SOURCES["code"]
    cfg = config.load_config(None, ["model.student=zoo:tiny-net/v2"])
    assert build_model(cfg.model.student, (1, 8, 8), 10)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert _digests(cfg, Code("model.student")) == [(Code("model.student").input_key, "")]


def test_a_logit_loss_added_to_the_registry_trains_and_is_named(monkeypatch):
    """The walk-through of docs/extending.md: one entry in LOGIT_LOSSES (and its test) is a new loss; no branch
    elsewhere names the methods."""
    from compress.distill.logit_losses import LogitLoss

    calls = []

    def squared(student, teacher, target, temperature, params):  # a stand-in loss: MSE of the logits
        calls.append(temperature)
        return ((student - teacher) ** 2).mean()

    monkeypatch.setitem(LOGIT_LOSSES, "squared", LogitLoss(squared, "logit MSE", "MSE between logits; a test",
                                                          {"temperature": 1.0, "weight": 2.0, "ce_weight": 0.5}))
    kd = dataclasses.replace(config.KDConfig(), method="squared")  # the registry's key, resolved at use
    d = dataclasses.replace(config.DistillConfig(), kd=kd)
    assert describe_loss(d).startswith("0.5 x cross-entropy + 2 x logit MSE (T 1)")

    class Student(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x), {}  # logits, {feature loss: the student's side}: none wired

    from compress.data.imageset import Batch

    x = torch.randn(5, 4)
    batch = Batch(x, torch.tensor([0, 1, 2, 0, 1]), torch.arange(5), torch.zeros(5, dtype=torch.long),
                  torch.tensor([0, 1, 2, 0, 1]), torch.ones(5))
    teacher = lambda x: {"logits": torch.zeros(len(x), 3)}  # noqa: E731
    total, terms = make_loss(d, Student(), teacher, None, steps_per_epoch=1)(batch, 0)
    assert calls == [1.0] and set(terms) == {"ce", "kd"} and torch.isfinite(total)


def test_a_feature_loss_added_to_the_registry_is_wired_trained_and_named(monkeypatch):
    """A feature loss is its registry entry plus its config section: with those two, the student and the frozen
    teacher are tapped at its layers, its term enters the loss with its weight and gradients reach the student,
    and the log names it; a weight of 0 leaves it out."""
    from compress.data.datasets import load_data
    from compress.distill.feature_losses import FeatureLoss
    from compress.distill.teacher import wire_features
    from compress.models.registry import build_model

    def attention_map(features, student_shape=None):  # spatial attention (Zagoruyko & Komodakis): a stand-in
        return torch.nn.functional.normalize(features.pow(2).mean(1).flatten(1), dim=1)

    def attention_loss(student, teacher):
        return (attention_map(student) - teacher).pow(2).mean()

    monkeypatch.setitem(FEATURE_LOSSES, "attention", FeatureLoss(attention_loss, "attention transfer",
                                                                 teacher_side=attention_map))
    sections = {name: config.DistillConfig.__dataclass_fields__[name].default_factory() for name in ("cosine", "hint")}
    attention = dataclasses.make_dataclass("AttentionConfig", [("weight", float, 0.0), ("student_layer", str, "block1"),
                                                               ("teacher_layer", str, "layers.2")], frozen=True)
    distill = dataclasses.make_dataclass("WithAttention", [("attention", attention, dataclasses.field(
        default_factory=attention))], bases=(config.DistillConfig,), frozen=True)
    data = load_data(config.load_config(None, ["data.name=digits"]).data, 0)
    torch.manual_seed(0)
    teacher_model, student_model = (build_model(name, data.input_shape, 10) for name in ("resnet8", "compact_cnn"))
    batch = data.train.batch(range(16))
    for weight in (0.0, 3.0):
        d = distill(attention=attention(weight=weight), **sections)
        student, teacher = wire_features(d, student_model, teacher_model, data.example())
        total, terms = make_loss(d, student, teacher, None, steps_per_epoch=1)(batch, 0)
        assert ("attention" in terms) == bool(weight)
        assert ("3 x attention transfer (teacher layers.2, student block1)" in describe_loss(d)) == bool(weight)
    logits, features = student(batch.x)
    expected = attention_loss(features["attention"], attention_map(teacher_model.layers(teacher_model.stem(batch.x))))
    assert terms["attention"] == pytest.approx(expected.item(), rel=1e-5)
    student_model.zero_grad()
    total.backward()
    assert student_model.block1[0][0].weight.grad.abs().sum() > 0


def test_registries_agree_cli_config_and_folders():
    """One stage registry (the CLI's --stages default comes from it); each stage's keys exist in the config."""
    from compress.run.config import config_slice

    run_option = next(p for p in cli.cli.commands["run"].params if p.name == "stages")
    assert tuple(stages.STAGES) == stages.ORDER and f"[default: {','.join(stages.ORDER)}]" in run_option.help
    config_sections = {f.name for f in dataclasses.fields(Config)}
    for name, module in stages.STAGES.items():
        assert module.NAME == name
        assert name in config_sections, f"stage {name} has no config section"
        assert all(out.startswith(f"{name}/") for out in module.OUTPUTS.values()), "a stage writes only its own folder"
        assert callable(module.run) and callable(module.inputs) and callable(module.report_rows)
        assert config_slice(Config(), module.CONFIG_KEYS)  # every declared key names a part of the config
        for item in module.inputs(Config()):  # every input names another stage's declared output, or images
            if isinstance(item, Images):
                assert item.key in ("root", "unlabeled")
                continue
            if isinstance(item, Code):
                assert item.key in ("model.teacher", "model.student")
                continue
            assert item.stage in stages.STAGES and item.output in stages.STAGES[item.stage].OUTPUTS
