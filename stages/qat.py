"""qat: quantization-aware fine-tuning of the float model (prepare_qat_fx -> DDP -> convert_fx), with an
accuracy budget against the float model."""

import logging
import os

import torch
import torch.nn.functional as F

from compress import dist, interrupt, mixed_precision, quant
from compress.checkpoint import read_metadata, read_weights, save_weights
from compress.context import Input, StageResult
from compress.data import eval_loader, load_data
from compress.deploy import speedup_text
from compress.dist import DistEnv
from compress.errors import Interrupted, StageFailed
from compress.models import build_model, count_parameters
from compress.train import build_optimizer, evaluate

log = logging.getLogger(__name__)

NAME = "qat"
SUMMARY = "quantization-aware fine-tuning (FX, DDP); int8 accuracy checked every epoch"
CONFIG_KEYS = ("seed", "data", "model", "qat", "export.latency_batch_sizes", "export.opset")
OUTPUTS = {"model": "qat/qat.safetensors", "metrics": "qat/metrics.json"}
RANK0_ONLY = False


def inputs(cfg):
    return [Input(cfg.qat.source, "model")]


def run(ctx):
    cfg, env, q = ctx.cfg, ctx.env, ctx.cfg.qat
    data = load_data(cfg.data, cfg.seed)
    model_name = cfg.model.student if q.source == "distill" else cfg.model.teacher
    float_model, _ = ctx.load_model((q.source, "model"), model_name, data)
    # QAT trains in fp32 whatever train.precision says: fake-quant observers learn the activation ranges the
    # int8 model will use, and bf16/fp16 rounding would shift those ranges away from the exported model's
    loader, val = ctx.loaders(data, q.batch_size, "qat.batch_size")
    full_val = eval_loader(data.val, cfg.train.eval_batch_size, 0, 1)
    float_acc = evaluate(float_model.to(env.device), val, env)["val_acc"]  # before prepare: it edits modules

    example = data.val.batch([0, 1]).x
    float_layers, figures = dist.on_main(env, choose_float_layers, ctx, float_model.cpu(), data)
    torch.manual_seed(cfg.seed)
    prepared = quant.prepare(float_model.cpu(), example, q.backend, q.activation_range, q.per_channel, float_layers)
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
        return F.cross_entropy(ddp_model(batch.x), batch.y, label_smoothing=q.label_smoothing), {}

    history = ctx.fit(ddp_model, modules={"model": prepared}, optimizer=build_optimizer(prepared.parameters(), q),
                      ocfg=q, loader=loader, loss_fn=loss_fn, evaluate_fn=evaluate_fn, on_epoch_start=on_epoch_start,
                      extra_state={"float_layers": float_layers, "mixed_precision": figures})

    mismatched = dist.replica_mismatches(env, prepared)
    dist.fail_if(env, mismatched, f"qat: ranks disagree on {len(mismatched)} tensors after training "
                 f"({', '.join(mismatched[:3])})")
    final = history[-1]
    metrics = {"float_acc": float_acc, "fake_quant_acc": final["val_acc"], "int8_acc": final["int8_acc"],
               "accuracy_drop": round(float_acc - final["int8_acc"], 4), "max_accuracy_drop": q.max_accuracy_drop,
               "params": count_parameters(prepared), "images_per_s": final["images_per_s"], "epochs": len(history),
               "replicas_identical": True, "buffers_identical": True, "float_layers": float_layers,
               "mixed_precision": figures, "qconfig": quant.describe_qconfig(q, float_layers)}
    if env.is_main:
        path = ctx.run.path(OUTPUTS["model"])
        save_weights(path, prepared, {**ctx.weights_metadata(model_name, data,
                                                            parent=ctx.input_sha256(q.source, "model")),
                                      "source": q.source, "qconfig": quant.describe_qconfig(q, float_layers)})
        metrics["rebuild_identical"] = _rebuild_matches(path, prepared, model_name, data, example,
                                                        quant.describe_qconfig(q, float_layers))
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


def choose_float_layers(ctx, float_model, data):
    """(float layer names, figures): qat.float_layers as given, the choice recorded by an interrupted run being
    resumed, or the latency-aware choice (compress.mixed_precision) measured now on validation images."""
    q, e = ctx.cfg.qat, ctx.cfg.export
    if q.float_layers is not None:
        return list(q.float_layers), {"mode": "qat.float_layers"}
    if ctx.resume:
        state = read_metadata(ctx.part_path(None, "last", "checkpoint.safetensors")).get("state") or {}
        extra = state.get("extra") or {}
        if isinstance(extra.get("float_layers"), list):
            return extra["float_layers"], extra.get("mixed_precision") or {}
    batch = max(e.latency_batch_sizes)
    images = data.val.batch(range(min(len(data.val), max(batch, 64)))).x
    calibration = list(images.split(32))
    timer = mixed_precision.Timer(float_model, calibration, images[:batch], q, threads=os.cpu_count() or 1,
                                  opset=e.opset)
    try:
        layers, figures = mixed_precision.choose_float_layers(timer, float_model, stop=stop_if_asked)
    except StageFailed as error:  # a candidate that does not export: quantize everything, as asked by default
        log.warning("qat: could not time the int8 candidates (%s); quantizing every layer", error)
        return [], {"mode": "all int8 (timing failed)"}
    finally:
        timer.close()
    figures = {"mode": "latency-aware (batch %d, %d threads)" % (batch, os.cpu_count() or 1), **figures}
    tried = "; ".join(f"{t['float']} float {t['with_float_ms']:.2f} ms vs int8 {t['int8_ms']:.2f} ms"
                      for t in figures["tried"])
    log.info("qat: with every layer int8 the student is %s; kept float: %s (%s)",
             _ratio(figures["fp32_ms"], figures["all_int8_ms"]), ", ".join(layers) or "none", tried)
    return layers, figures


def _ratio(fp32_ms, int8_ms):
    return speedup_text(fp32_ms / int8_ms) + " than fp32" if int8_ms else "n/a"


def stop_if_asked(where="while timing int8 candidates"):
    if interrupt.local_request():
        raise Interrupted(f"interrupted in qat ({where}); rerun the same command to continue")


def _rebuild_matches(path, prepared, model_name, data, example, q):
    """Export rebuilds int8 from the saved file: prove now that it gives the same outputs."""
    tensors, _ = read_weights(path, expect_stage="qat")
    rebuilt = quant.rebuild_int8(build_model(model_name, data.input_shape, data.num_classes), tensors, example, q,
                                 path)
    x = data.val.batch(range(min(64, len(data.val)))).x
    with torch.no_grad():
        return bool(torch.equal(quant.convert(prepared)(x), rebuilt(x)))
