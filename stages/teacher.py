"""teacher: train the large model under DDP on the configured data - or, given `model.teacher_weights` and
`teacher.epochs: 0`, take that teacher as it is and only evaluate it."""

import logging

import torch

from compress.fileio import atomic_write_json
from compress.models.registry import build_model, count_parameters
from compress.models.weights import load_pretrained, normalisation_note, weights_of
from compress.run.contract import Code, File, Images, StageResult
from compress.run.report import evaluated_in, file_size
from compress.training import distributed as dist
from compress.training.checkpoint import save_weights
from compress.training.loop import evaluate, fit
from compress.training.losses import label_loss
from compress.training.schedule import Schedule, build_optimizer

NAME = "teacher"
SUMMARY = "train the large model (DDP)"
CONFIG_KEYS = ("seed", "data", "-data.unlabeled", "model.teacher", "model.teacher_weights", "teacher")
OUTPUTS = {"model": "teacher/model.safetensors", "metrics": "teacher/metrics.json"}
PARTS = ("",)
RANK0_ONLY = False

log = logging.getLogger(__name__)


def inputs(cfg):
    weights = weights_of(cfg.model, "teacher")
    return [Images("root"), Code("model.teacher"), *([File(weights, "model.teacher_weights")] if weights else [])]


def build_teacher(cfg, data):
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank (DDP also broadcasts rank 0's)
    model = build_model(cfg.model.teacher, data.input_shape, data.num_classes)
    if cfg.model.teacher_weights:
        note = load_pretrained(model, weights_of(cfg.model, "teacher"), "model.teacher_weights", cfg.model.teacher)
        log.info("teacher: %s%s", note, normalisation_note(cfg.model.teacher_weights, cfg.data))
    return model


def run(ctx):
    cfg, env, t = ctx.cfg, ctx.env, ctx.cfg.teacher
    data = ctx.load_data()
    model = build_teacher(cfg, data).to(env.device)  # a wrong weights file fails here: nothing written
    precision = ctx.precision([model], data.train.batch([0]).x, training=t.epochs > 0)
    train_set = data.train.with_augment(mix=t.mix, mix_alpha=t.mix_alpha)
    loader, val = ctx.loaders(train_set, data.val, t.batch_size, "teacher.batch_size")
    ctx.begin()
    if t.epochs == 0:
        return _as_given(ctx, model, data, val, precision)
    ddp_model = dist.wrap_ddp(model, env)
    optimizer = build_optimizer(model.parameters(), t)
    schedule = Schedule.from_config(t, loader.sampler.batches_per_epoch)
    session = ctx.session({"model": model}, optimizer, schedule.steps_per_epoch, t.epochs, precision=precision)

    def loss_fn(batch, step):
        return label_loss(ddp_model(batch.x), batch, t.label_smoothing), {}

    history = fit(ddp_model, loss_fn, optimizer, loader, schedule, lambda epoch: evaluate(model, val, env, precision),
                  session)
    replicas = dist.check_replicas(env, model, "teacher")
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["model"]), model, ctx.weights_metadata(cfg.model.teacher, data))
    final = history[-1]
    metrics = {"val_acc": final["val_acc"], "val_loss": final["val_loss"], "params": count_parameters(model),
               "images_per_s": final["images_per_s"], "epochs": len(history), "replicas_identical": replicas,
               **precision.describe()}
    return StageResult(metrics, list(OUTPUTS.values()), f"teacher {cfg.model.teacher}: val acc {final['val_acc']:.2f}%")


def _as_given(ctx, model, data, val, precision):
    """teacher.epochs: 0 - record the given teacher (evaluated, saved in compress's format) without training."""
    cfg, env = ctx.cfg, ctx.env
    metrics = {**evaluate(model, val, env, precision), "params": count_parameters(model), "epochs": 0,
               "trained": False, **precision.describe()}
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["model"]), model, ctx.weights_metadata(cfg.model.teacher, data))
        atomic_write_json(ctx.run.path(OUTPUTS["metrics"]), {"stage": "teacher", "epochs": [], "evaluated": metrics})
    return StageResult(metrics, list(OUTPUTS.values()),
                       f"teacher {cfg.model.teacher} used as given: val acc {metrics['val_acc']:.2f}%")


def report_rows(entry, path):
    """The teacher's row of the run report (its latency comes from the export stage, which times it)."""
    m = entry["metrics"]
    return [{"id": "teacher", "artifact": f"teacher ({evaluated_in(m)})", "file": OUTPUTS["model"],
             "params": m["params"], "size_bytes": file_size(path("model")), "val_acc": m["val_acc"]}]
