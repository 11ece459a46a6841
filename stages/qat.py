"""qat: quantization-aware fine-tuning of the float model (prepare_qat_fx -> DDP -> convert_fx), with an
accuracy budget against the float model."""

import logging

import torch
import torch.nn.functional as F

from compress import dist, quant
from compress.checkpoint import read_weights, save_weights
from compress.context import Input, StageResult
from compress.data import eval_loader, load_data, train_loader
from compress.dist import DistEnv
from compress.models import build_model, count_parameters
from compress.train import build_optimizer, evaluate

log = logging.getLogger(__name__)

NAME = "qat"
SUMMARY = "quantization-aware fine-tuning (FX, DDP); int8 accuracy checked every epoch"
CONFIG_KEYS = ("seed", "data", "model", "qat")
OUTPUTS = {"model": "qat/qat.safetensors", "metrics": "qat/metrics.json"}
RANK0_ONLY = False


def inputs(cfg):
    return [Input(cfg.qat.source, "model")]


def run(ctx):
    cfg, env, q = ctx.cfg, ctx.env, ctx.cfg.qat
    data = load_data(cfg.data, cfg.seed)
    model_name = cfg.model.student if q.source == "distill" else cfg.model.teacher
    float_model, _ = ctx.load_model((q.source, "model"), model_name, data)
    val = eval_loader(data.val, cfg.train.eval_batch_size, env.rank, env.world, cfg.train.num_workers)
    full_val = eval_loader(data.val, cfg.train.eval_batch_size, 0, 1)
    float_acc = evaluate(float_model.to(env.device), val, env)["val_acc"]  # before prepare: it edits modules

    example = data.val.batch([0, 1]).x
    torch.manual_seed(cfg.seed)
    prepared = quant.prepare(float_model.cpu(), example, q.backend, q.activation_range, q.per_channel)
    ctx.begin()
    prepared.to(env.device)
    ddp_model = dist.wrap_ddp(prepared, env)  # prepare first, then DDP: never the other way round

    def on_epoch_start(epoch):  # idempotent, so a resumed run re-applies the same schedule
        if epoch >= q.freeze_observers_after:
            quant.freeze_observers(prepared)
        if epoch >= q.freeze_bn_after:
            quant.freeze_bn(prepared)

    def evaluate_fn(epoch):
        with quant.observers_paused(prepared):
            fake = evaluate(prepared, val, env)
        int8_acc = dist.on_main(env, lambda: evaluate(quant.convert(prepared), full_val, DistEnv())["val_acc"])
        return {**fake, "int8_acc": int8_acc}

    def loss_fn(batch):
        return F.cross_entropy(ddp_model(batch.x), batch.y), {}

    batch = dist.per_rank_batch(q.batch_size, env, "qat.batch_size")
    loader = train_loader(data.train, batch, env.rank, env.world, cfg.seed, cfg.train.num_workers)
    history = ctx.fit(ddp_model, modules={"model": prepared}, optimizer=build_optimizer(prepared.parameters(), q),
                      ocfg=q, loader=loader, loss_fn=loss_fn, evaluate_fn=evaluate_fn, on_epoch_start=on_epoch_start)

    mismatched = dist.replica_mismatches(env, prepared)
    dist.fail_if(env, mismatched, f"qat: ranks disagree on {len(mismatched)} tensors after training "
                 f"({', '.join(mismatched[:3])})")
    final = history[-1]
    metrics = {"float_acc": float_acc, "fake_quant_acc": final["val_acc"], "int8_acc": final["int8_acc"],
               "accuracy_drop": round(float_acc - final["int8_acc"], 4), "max_accuracy_drop": q.max_accuracy_drop,
               "params": count_parameters(prepared), "images_per_s": final["images_per_s"], "epochs": len(history),
               "replicas_identical": True, "buffers_identical": True,
               "qconfig": quant.describe_qconfig(q)}
    if env.is_main:
        path = ctx.run.path(OUTPUTS["model"])
        save_weights(path, prepared, {**ctx.weights_metadata(model_name, data,
                                                            parent=ctx.input_sha256(q.source, "model")),
                                      "source": q.source, "qconfig": quant.describe_qconfig(q)})
        metrics["rebuild_identical"] = _rebuild_matches(path, prepared, model_name, data, example, q)
    dist.barrier(env)
    summary = (f"{model_name}: float {float_acc:.2f}%, fake-quant {final['val_acc']:.2f}%, "
               f"int8 {final['int8_acc']:.2f}%")
    dist.fail_if(env, metrics["accuracy_drop"] > q.max_accuracy_drop,
                 f"qat: int8 accuracy {final['int8_acc']:.2f}% is {metrics['accuracy_drop']:.2f} points below the "
                 f"float model's {float_acc:.2f}%, over the budget qat.max_accuracy_drop={q.max_accuracy_drop}; "
                 f"outputs kept in {ctx.run.rel(ctx.stage_path())}/ for inspection")
    return StageResult(metrics, list(OUTPUTS.values()), summary)


def report_rows(entry, path):
    m = entry["metrics"]
    return [{"id": "qat", "artifact": "student QAT int8 (PyTorch)", "file": OUTPUTS["model"], "params": m["params"],
             "val_acc": m["int8_acc"]}]


def _rebuild_matches(path, prepared, model_name, data, example, q):
    """Export rebuilds int8 from the saved file: prove now that it gives the same outputs."""
    tensors, _ = read_weights(path, expect_stage="qat")
    rebuilt = quant.rebuild_int8(build_model(model_name, data.input_shape, data.num_classes), tensors, example,
                                 q.backend, q.activation_range, q.per_channel, path)
    x = data.val.batch(range(min(64, len(data.val)))).x
    with torch.no_grad():
        return bool(torch.equal(quant.convert(prepared)(x), rebuilt(x)))
