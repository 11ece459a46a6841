"""qat: quantization-aware fine-tuning of the float model (prepare_qat_fx -> DDP -> convert_fx), with an
accuracy budget against the float model."""

import logging
import math

import torch

from compress.data.sampling import eval_loader
from compress.deploy.latency import default_threads
from compress.models.registry import build_model, count_parameters
from compress.quant import fx, mixed_precision
from compress.quant.objective import frozen_copy, qat_loss
from compress.run.config import QAT_SOURCES, quantized_model
from compress.run.contract import Code, Images, Input, StageResult
from compress.training import distributed as dist
from compress.training import interrupt
from compress.training.checkpoint import read_weights, save_weights
from compress.training.distributed import DistEnv
from compress.training.loop import evaluate, fit
from compress.training.precision import Precision
from compress.training.schedule import Schedule, build_optimizer

log = logging.getLogger(__name__)

NAME = "qat"
SUMMARY = "quantization-aware fine-tuning (FX, DDP); int8 accuracy checked every epoch"
CONFIG_KEYS = ("seed", "data", "-data.unlabeled", "model", "qat", "export.latency_batch_sizes",
               "export.latency_threads", "export.opset")
OUTPUTS = {"model": "qat/qat.safetensors", "metrics": "qat/metrics.json"}
PARTS = ("",)
RANK0_ONLY = False


def inputs(cfg):
    source = QAT_SOURCES[cfg.qat.source]
    return [Input(source.stage, source.output), Images("root"), Code(source.model_key)]


def run(ctx):
    cfg, env, q = ctx.cfg, ctx.env, ctx.cfg.qat
    data = ctx.load_data()
    model_name, source = quantized_model(cfg.model, q.source), QAT_SOURCES[q.source]
    float_model, _ = ctx.load_model(source.stage, model_name, data, source.output)
    loader, val = ctx.loaders(data.train, data.val, q.batch_size, "qat.batch_size")
    full_val = eval_loader(data.val, cfg.train.eval_batch_size, 0, 1)
    float_acc = evaluate(float_model.to(env.device), val, env)["val_acc"]  # before prepare: it edits modules
    reference = frozen_copy(float_model) if q.kd_weight else None  # the float model QAT distils from

    example = data.example()
    float_layers, figures = dist.on_main(env, choose_float_layers, ctx, float_model.cpu(), data)
    torch.manual_seed(cfg.seed)
    prepared = fx.prepare(float_model.cpu(), example, q.backend, q.activation_range, q.per_channel, float_layers)
    ctx.begin()
    prepared.to(env.device)
    # fp32 whatever train.precision says: fake-quant observers learn the activation ranges the int8 model will
    # use, and bf16/fp16 rounding would shift those ranges away from the exported model's
    ctx.precision([prepared], example, fixed=Precision(reason="always: the observers learn int8 ranges in fp32"))
    ddp_model = dist.wrap_ddp(prepared, env)  # prepare first, then DDP: never the other way round

    def on_epoch_start(epoch):  # idempotent, so a resumed run re-applies the same schedule
        if epoch >= q.freeze_observers_after:
            fx.freeze_observers(prepared)
        if epoch >= q.freeze_bn_after:
            fx.freeze_bn(prepared)

    def evaluate_fn(epoch):
        with fx.observers_paused(prepared):
            fake = evaluate(prepared, val, env)
        int8_acc = dist.on_main(env, lambda: evaluate(fx.convert(prepared), full_val, DistEnv())["val_acc"])
        return {**fake, "int8_acc": int8_acc}

    optimizer = build_optimizer(prepared.parameters(), q)
    schedule = Schedule.from_config(q, loader.sampler.batches_per_epoch)
    session = ctx.session({"model": prepared}, optimizer, schedule.steps_per_epoch, q.epochs,
                          extra={"float_layers": float_layers, "mixed_precision": figures})
    history = fit(ddp_model, qat_loss(q, ddp_model, reference), optimizer, loader, schedule, evaluate_fn, session,
                  on_epoch_start)
    replicas = dist.check_replicas(env, prepared, "qat")  # buffers too: observers and BN statistics are frozen
    final = history[-1]
    qconfig = fx.describe_qconfig(q, float_layers)
    metrics = {"float_acc": float_acc, "fake_quant_acc": final["val_acc"], "int8_acc": final["int8_acc"],
               "accuracy_drop": round(float_acc - final["int8_acc"], 4), "max_accuracy_drop": q.max_accuracy_drop,
               "params": count_parameters(prepared), "images_per_s": final["images_per_s"], "epochs": len(history),
               "replicas_identical": replicas, "buffers_identical": replicas, "float_layers": float_layers,
               "mixed_precision": figures, "qconfig": qconfig}
    if env.is_main:
        path = ctx.run.path(OUTPUTS["model"])
        parent = ctx.input_sha256(source.stage, source.output)
        save_weights(path, prepared, {**ctx.weights_metadata(model_name, data, parent=parent), "source": q.source,
                                      "qconfig": qconfig})
        metrics["rebuild_identical"] = _rebuild_matches(path, prepared, model_name, data, example, qconfig)
    dist.barrier(env)
    summary = (f"{model_name}: float {float_acc:.2f}%, fake-quant {final['val_acc']:.2f}%, "
               f"int8 {final['int8_acc']:.2f}%")
    over = metrics["accuracy_drop"] > q.max_accuracy_drop
    dist.fail_if(env, over, _budget_message(ctx, metrics, q, data.num_classes, len(data.val)) if over else "")
    return StageResult(metrics, list(OUTPUTS.values()), summary)


def _budget_message(ctx, m, q, classes, images):
    """The accuracy-budget failure, with the keys that change the outcome and values to try."""
    allow = math.ceil(m["accuracy_drop"] + 0.5)
    one = 100.0 / images  # points a single validation image is worth
    advice = (f"accept the loss with --set qat.max_accuracy_drop={allow} (this model is judged again, not retrained; "
              f"export still weighs onnxruntime's post-training quantization beside it), or let QAT recover it: "
              f"more epochs (--set qat.epochs={2 * q.epochs}) or a gentler learning rate (--set qat.lr={q.lr / 2:g})")
    chance = 100.0 / classes
    if m["float_acc"] < 2 * chance:
        advice += (f"; the float model itself is at {m['float_acc']:.2f}% (chance: {chance:.1f}%): train the teacher "
                   "and the student longer first (teacher.epochs, distill.epochs)")
    if one > q.max_accuracy_drop:
        advice += (f"; one validation image is worth {one:.2f} points here, more than the budget: a single image "
                   "fails it, so add validation images or allow at least that much")
    return (f"qat: int8 accuracy {m['int8_acc']:.2f}% is {m['accuracy_drop']:.2f} points below the float model's "
            f"{m['float_acc']:.2f}% ({round(m['accuracy_drop'] / one)} of {images:,} validation images), over the "
            f"budget qat.max_accuracy_drop={q.max_accuracy_drop}; {advice}; outputs kept in "
            f"{ctx.run.rel(ctx.stage_path())}/ for inspection")


def report_rows(entry, path):
    m = entry["metrics"]
    return [{"id": "qat", "artifact": "student QAT int8 (PyTorch)", "file": OUTPUTS["model"], "params": m["params"],
             "val_acc": m["int8_acc"]}]


def choose_float_layers(ctx, float_model, data):
    """(float layer names, figures): qat.float_layers as given, the choice recorded by an interrupted run being
    resumed, or the latency-aware choice measured now on validation images (compress.quant.mixed_precision)."""
    q, e = ctx.cfg.qat, ctx.cfg.export
    if q.float_layers is not None:
        return list(q.float_layers), {"mode": "qat.float_layers"}
    resumed = ctx.state.resume_of("")
    if resumed is not None and isinstance(resumed.extra.get("float_layers"), list):
        return resumed.extra["float_layers"], resumed.extra.get("mixed_precision") or {}
    batch = max(e.latency_batch_sizes)
    images = data.val.batch(range(min(len(data.val), max(batch, 64)))).x
    threads = max(e.latency_threads or default_threads())  # the thread count of the cell the export verdict weighs
    stop = lambda: interrupt.stop_if_asked("in qat (while timing int8 candidates)")  # noqa: E731
    return mixed_precision.timed_choice(float_model, images, batch, threads, q, e.opset,
                                        quantized_model(ctx.cfg.model, q.source), stop)


def _rebuild_matches(path, prepared, model_name, data, example, q):
    """Export rebuilds int8 from the saved file: prove now that it gives the same outputs."""
    tensors, _ = read_weights(path, expect_stage="qat")
    rebuilt = fx.rebuild_int8(build_model(model_name, data.input_shape, data.num_classes), tensors, example, q, path)
    x = data.val.batch(range(min(64, len(data.val)))).x
    with torch.no_grad():
        return bool(torch.equal(fx.convert(prepared)(x), rebuilt(x)))
