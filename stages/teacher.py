"""teacher: train the large model under DDP on the configured data - or, given `model.teacher_weights` and
`teacher.epochs: 0`, take that teacher as it is and only evaluate it."""

import logging

import torch
import torch.nn.functional as F

from compress import dist
from compress.checkpoint import save_weights
from compress.context import File, StageResult
from compress.data import load_data
from compress.model_sources import load_pretrained
from compress.models import build_model, count_parameters
from compress.report import file_size
from compress.train import build_optimizer, evaluate

NAME = "teacher"
SUMMARY = "train the large model (DDP)"
CONFIG_KEYS = ("seed", "data", "model.teacher", "model.teacher_weights", "teacher")
OUTPUTS = {"model": "teacher/model.safetensors", "metrics": "teacher/metrics.json"}
RANK0_ONLY = False


log = logging.getLogger(__name__)


def inputs(cfg):
    weights = cfg.model.teacher_weights
    return [File(weights, "model.teacher_weights")] if weights else []


def build_teacher(cfg, data):
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank (DDP also broadcasts rank 0's)
    model = build_model(cfg.model.teacher, data.input_shape, data.num_classes)
    if cfg.model.teacher_weights:
        note = load_pretrained(model, cfg.model.teacher_weights, "model.teacher_weights")
        log.info("teacher: %s", note)
    return model


def run(ctx):
    cfg, env = ctx.cfg, ctx.env
    data = load_data(cfg.data, cfg.seed)
    precision = ctx.precision()
    model = build_teacher(cfg, data).to(env.device)  # a wrong weights file fails here: nothing written
    precision = precision.place([model], data.train.batch([0]).x)
    loader, val = ctx.loaders(data, cfg.teacher.batch_size, "teacher.batch_size")
    ctx.begin()
    if cfg.teacher.epochs == 0:
        return _as_given(ctx, model, data, val, precision)
    ddp_model = dist.wrap_ddp(model, env)

    def loss_fn(batch):
        return F.cross_entropy(ddp_model(batch.x), batch.y), {}

    history = ctx.fit(ddp_model, modules={"model": model}, optimizer=build_optimizer(model.parameters(), cfg.teacher),
                      ocfg=cfg.teacher, loader=loader, loss_fn=loss_fn, precision=precision,
                      evaluate_fn=lambda epoch: evaluate(model, val, env, precision))
    mismatched = dist.replica_mismatches(env, model)
    dist.fail_if(env, mismatched, f"teacher: ranks disagree on {len(mismatched)} tensors after training "
                 f"({', '.join(mismatched[:3])}); DDP went out of sync")
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["model"]), model, ctx.weights_metadata(cfg.model.teacher, data))
    final = history[-1]
    metrics = {"val_acc": final["val_acc"], "val_loss": final["val_loss"], "params": count_parameters(model),
               "images_per_s": final["images_per_s"], "epochs": len(history), "replicas_identical": True,
               "precision": precision.name, "memory_format": precision.layout}
    return StageResult(metrics, list(OUTPUTS.values()), f"teacher {cfg.model.teacher}: val acc {final['val_acc']:.2f}%")


def _as_given(ctx, model, data, val, precision):
    """teacher.epochs: 0 - record the given teacher (evaluated, saved in compress's format) without training."""
    cfg, env = ctx.cfg, ctx.env
    metrics = {**evaluate(model, val, env, precision), "params": count_parameters(model), "epochs": 0,
               "trained": False, "precision": precision.name}
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["model"]), model, ctx.weights_metadata(cfg.model.teacher, data))
        from compress.fileio import atomic_write_json

        atomic_write_json(ctx.run.path(OUTPUTS["metrics"]), {"stage": "teacher", "epochs": [], "evaluated": metrics})
    return StageResult(metrics, list(OUTPUTS.values()),
                       f"teacher {cfg.model.teacher} used as given: val acc {metrics['val_acc']:.2f}%")


def report_rows(entry, path):
    """The teacher's row of the run report (its latency comes from the export stage, which times it)."""
    m = entry["metrics"]
    return [{"id": "teacher", "artifact": "teacher (PyTorch fp32)", "file": OUTPUTS["model"], "params": m["params"],
             "size_bytes": file_size(path("model")), "val_acc": m["val_acc"]}]
