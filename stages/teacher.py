"""teacher: train the large model under DDP on the configured data."""

import torch
import torch.nn.functional as F

from compress import dist
from compress.checkpoint import save_weights
from compress.context import StageResult
from compress.data import eval_loader, load_data, train_loader
from compress.models import build_model, count_parameters
from compress.report import file_size
from compress.train import build_optimizer, evaluate

NAME = "teacher"
SUMMARY = "train the large model (DDP)"
CONFIG_KEYS = ("seed", "data", "model.teacher", "teacher")
OUTPUTS = {"model": "teacher/model.safetensors", "metrics": "teacher/metrics.json"}
RANK0_ONLY = False


def inputs(cfg):
    return []


def run(ctx):
    cfg, env = ctx.cfg, ctx.env
    data = load_data(cfg.data, cfg.seed)
    ctx.begin()
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank (DDP also broadcasts rank 0's)
    model = build_model(cfg.model.teacher, data.input_shape, data.num_classes).to(env.device)
    ddp_model = dist.wrap_ddp(model, env)
    batch = dist.per_rank_batch(cfg.teacher.batch_size, env, "teacher.batch_size")
    loader = train_loader(data.train, batch, env.rank, env.world, cfg.seed, cfg.train.num_workers)
    val = eval_loader(data.val, cfg.train.eval_batch_size, env.rank, env.world, cfg.train.num_workers)

    def loss_fn(batch):
        return F.cross_entropy(ddp_model(batch.x), batch.y), {}

    history = ctx.fit(ddp_model, modules={"model": model}, optimizer=build_optimizer(model.parameters(), cfg.teacher),
                      ocfg=cfg.teacher, loader=loader, loss_fn=loss_fn,
                      evaluate_fn=lambda epoch: evaluate(model, val, env))
    mismatched = dist.replica_mismatches(env, model)
    dist.fail_if(env, mismatched, f"teacher: ranks disagree on {len(mismatched)} tensors after training "
                 f"({', '.join(mismatched[:3])}); DDP went out of sync")
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["model"]), model, ctx.weights_metadata(cfg.model.teacher, data))
    final = history[-1]
    metrics = {"val_acc": final["val_acc"], "val_loss": final["val_loss"], "params": count_parameters(model),
               "images_per_s": final["images_per_s"], "epochs": len(history), "replicas_identical": True}
    return StageResult(metrics, list(OUTPUTS.values()), f"teacher {cfg.model.teacher}: val acc {final['val_acc']:.2f}%")


def report_rows(entry, path):
    """The teacher's row of the run report (its latency comes from the export stage, which times it)."""
    m = entry["metrics"]
    return [{"id": "teacher", "artifact": "teacher (PyTorch fp32)", "file": OUTPUTS["model"], "params": m["params"],
             "size_bytes": file_size(path("model")), "val_acc": m["val_acc"]}]
