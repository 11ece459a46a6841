"""distill: train the small student from the frozen teacher - any weighted mix of cross-entropy, Hinton KD
on logits, cosine loss on hidden representations, and a FitNets hint through a trainable regressor."""

import copy
import dataclasses
import logging
import time

import torch
import torch.nn.functional as F

from compress import dist
from compress.checkpoint import save_weights
from compress.context import File, Input, StageResult
from compress.data import load_data, train_loader
from compress.distillation import (
    FrozenTeacher,
    StudentWithRegressor,
    build_cache,
    cache_bytes,
    probe_shapes,
)
from compress.losses import (
    cosine_loss,
    hint_loss,
    kd_loss,
    make_regressor,
    reduce_width,
)
from compress.model_sources import load_pretrained
from compress.models import build_model, count_parameters
from compress.report import file_size
from compress.train import build_optimizer, evaluate

log = logging.getLogger(__name__)

NAME = "distill"
SUMMARY = "train the small student from the frozen teacher (KD, cosine, hint)"
CONFIG_KEYS = ("seed", "data", "model.teacher", "model.student", "model.student_weights", "distill")
OUTPUTS = {"model": "distill/model.safetensors", "metrics": "distill/metrics.json",
           "baseline": "distill/baseline.safetensors", "baseline_metrics": "distill/baseline/metrics.json"}
RANK0_ONLY = False


def inputs(cfg):
    weights = cfg.model.student_weights
    return [Input("teacher", "model"), *([File(weights, "model.student_weights")] if weights else [])]


def new_student(cfg, data):
    """The plain student: seeded initialisation, or the weights of model.student_weights."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.student, data.input_shape, data.num_classes)
    if cfg.model.student_weights:
        log.info("distill: %s", load_pretrained(model, cfg.model.student_weights, "model.student_weights"))
    return model


def build_student(cfg, data, teacher):
    """Student (+ hint regressor) wired to the teacher's layers; shapes are checked before any training."""
    d = cfg.distill
    student = StudentWithRegressor(new_student(cfg, data),
                                   cosine_layer=d.cosine.student_layer if d.cosine.weight else None,
                                   hint_layer=d.hint.student_layer if d.hint.weight else None)
    example = data.val.batch([0, 1]).x
    shapes = probe_shapes(student, teacher, example)
    if d.cosine.weight:
        width = shapes[("student", d.cosine.student_layer)]
        teacher.cosine_width = int(torch.Size(width).numel())
        reduce_width(torch.zeros(1, *shapes[("teacher", d.cosine.teacher_layer)]), teacher.cosine_width)
    if d.hint.weight:
        s_shape, t_shape = shapes[("student", d.hint.student_layer)], shapes[("teacher", d.hint.teacher_layer)]
        student.add_regressor(make_regressor(d.hint.regressor, s_shape, t_shape))
    return student


def make_loss(cfg, ddp_student, teacher, cache, device):
    """The weighted mix of CE, KD, cosine and hint; the teacher's outputs come from the cache (by sample and
    view) or from running the frozen teacher on the very batch the student sees."""
    d = cfg.distill

    def loss_fn(batch):
        x, y = batch.x, batch.y
        logits, s_cosine, s_hint = ddp_student(x)
        t = cache.lookup(batch.index, batch.view, device) if cache is not None else teacher(x)
        terms = {}
        if d.ce_weight:
            terms["ce"] = (d.ce_weight, F.cross_entropy(logits, y, label_smoothing=d.label_smoothing))
        if d.kd.weight:
            terms["kd"] = (d.kd.weight, kd_loss(logits, t["logits"], d.kd.temperature))
        if d.cosine.weight:
            terms["cosine"] = (d.cosine.weight, cosine_loss(s_cosine, t["cosine"]))
        if d.hint.weight:
            terms["hint"] = (d.hint.weight, hint_loss(s_hint, t["hint"]))
        total = sum(w * value for w, value in terms.values())
        return total, {k: value.item() for k, (_, value) in terms.items()}

    return loss_fn


def run(ctx):
    cfg, env, d = ctx.cfg, ctx.env, ctx.cfg.distill
    data = load_data(cfg.data, cfg.seed)
    augmented = data.train.augment.active
    data.train.augment.views = d.views if augmented and d.cache_teacher else 0
    teacher_model, _ = ctx.load_model(("teacher", "model"), cfg.model.teacher, data)
    teacher = FrozenTeacher(teacher_model, cosine_layer=d.cosine.teacher_layer if d.cosine.weight else None,
                            hint_layer=d.hint.teacher_layer if d.hint.weight else None)
    student = build_student(cfg, data, teacher)  # shapes probed on the CPU, then moved
    precision = ctx.precision()
    for model in (student, teacher.model):
        model.to(env.device)
    precision = precision.place([student, teacher.model], data.train.batch([0]).x)
    loader, val = ctx.loaders(data, d.batch_size, "distill.batch_size")
    ctx.begin()
    cache, cache_info = _teacher_outputs(ctx, teacher, data, precision)
    ddp_student = dist.wrap_ddp(student, env)
    modules = {"student": student.student}
    if student.regressor is not None:
        modules["regressor"] = student.regressor
    history = ctx.fit(ddp_student, modules=modules, optimizer=build_optimizer(student.parameters(), d), ocfg=d,
                      loader=loader, loss_fn=make_loss(cfg, ddp_student, teacher, cache, env.device),
                      evaluate_fn=lambda epoch: evaluate(student.student, val, env, precision), precision=precision)
    mismatched = dist.replica_mismatches(env, student)
    dist.fail_if(env, mismatched, f"distill: ranks disagree on {len(mismatched)} tensors after training "
                 f"({', '.join(mismatched[:3])}); DDP went out of sync")
    parent = ctx.input_sha256("teacher", "model")
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["model"]), student.student,
                     ctx.weights_metadata(cfg.model.student, data, parent=parent))
    baseline = _train_baseline(ctx, data, val, precision) if d.baseline else None
    teacher_acc = evaluate(teacher.model, val, env, precision)["val_acc"]
    final = history[-1]
    metrics = {"val_acc": final["val_acc"], "val_loss": final["val_loss"], "teacher_val_acc": teacher_acc,
               "params": count_parameters(student.student), "teacher_params": count_parameters(teacher.model),
               "images_per_s": final["images_per_s"], "epochs": len(history), "replicas_identical": True,
               "precision": precision.name, "memory_format": precision.layout, "teacher_outputs": cache_info,
               "losses": [k for k, w in (("ce", d.ce_weight), ("kd", d.kd.weight), ("cosine", d.cosine.weight),
                                         ("hint", d.hint.weight)) if w]}
    summary = f"student {cfg.model.student}: val acc {final['val_acc']:.2f}% (teacher {teacher_acc:.2f}%)"
    outputs = [OUTPUTS["model"], OUTPUTS["metrics"]]
    if baseline:
        metrics.update(baseline_val_acc=baseline["val_acc"], gain_points=round(final["val_acc"] - baseline["val_acc"],
                                                                               4))
        summary += f"; trained alone {baseline['val_acc']:.2f}% ({metrics['gain_points']:+.2f} points from distilling)"
        outputs += [OUTPUTS["baseline"], OUTPUTS["baseline_metrics"]]
    return StageResult(metrics, outputs, summary)


def _teacher_outputs(ctx, teacher, data, precision):
    """The teacher-output cache for this run (None: the teacher runs on every batch) and what it cost."""
    env, d = ctx.env, ctx.cfg.distill
    views = data.train.augment.views
    if not d.cache_teacher or (data.train.augment.active and not views):
        return None, {"mode": "teacher on every batch"}
    need = cache_bytes(teacher, data.train, views)
    if need > d.cache_mb * 2**20:
        if env.is_main:
            log.warning("distill: caching the teacher's outputs would take %d MB (distill.cache_mb=%d); running the "
                        "teacher on every batch instead", need // 2**20, d.cache_mb)
        return None, {"mode": "teacher on every batch (cache over distill.cache_mb)"}
    start = time.perf_counter()
    with precision.autocast():
        cache = build_cache(teacher, data.train, env, d.batch_size, views,
                            inputs=lambda x: precision.inputs(x, env.device))
    seconds = time.perf_counter() - start
    what = f"{views} fixed augmented views of each of" if views else "each of the"
    if env.is_main:
        log.info("distill: teacher outputs for %s %d training images computed once (%.1f MB) in %.1fs", what,
                 len(data.train), cache.nbytes() / 1e6, seconds)
    return cache, {"mode": f"cached, {views} views per image" if views else "cached, un-augmented images",
                   "views": views, "seconds": round(seconds, 2), "megabytes": round(cache.nbytes() / 1e6, 2)}


def _train_baseline(ctx, data, val, precision):
    """The same student trained alone - cross-entropy only, same initialisation, schedule, seed and data order,
    augmented afresh every epoch as plain training would be - so the run states what distillation gained."""
    cfg, env, d = ctx.cfg, ctx.env, ctx.cfg.distill
    model = new_student(cfg, data).to(env.device)
    precision = precision.place([model], data.train.batch([0]).x)
    ddp_model = dist.wrap_ddp(model, env)
    plain = copy.copy(data.train)
    plain.augment = dataclasses.replace(data.train.augment, views=0)
    loader = train_loader(plain, dist.per_rank_batch(d.batch_size, env, "distill.batch_size"), env.rank, env.world,
                          cfg.seed, cfg.train.num_workers, env.device.type == "cuda")

    def loss_fn(batch):
        return F.cross_entropy(ddp_model(batch.x), batch.y, label_smoothing=d.label_smoothing), {}

    history = ctx.fit(ddp_model, modules={"student": model}, optimizer=build_optimizer(model.parameters(), d), ocfg=d,
                      loader=loader, loss_fn=loss_fn, evaluate_fn=lambda epoch: evaluate(model, val, env, precision),
                      precision=precision, part="baseline")
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["baseline"]), model,
                     {**ctx.weights_metadata(cfg.model.student, data), "role": "baseline: trained alone, CE only"})
    return history[-1]


def report_rows(entry, path):
    m = entry["metrics"]
    rows = [{"id": "student", "artifact": "student, distilled (PyTorch fp32)", "file": OUTPUTS["model"],
             "params": m["params"], "size_bytes": file_size(path("model")), "val_acc": m["val_acc"]}]
    if "baseline_val_acc" in m:
        rows.append({"id": "baseline", "artifact": "student alone, no teacher (PyTorch fp32)",
                     "file": OUTPUTS["baseline"], "params": m["params"], "size_bytes": file_size(path("baseline")),
                     "val_acc": m["baseline_val_acc"]})
    return rows


def report_notes(entry):
    m = entry["metrics"]
    if "baseline_val_acc" not in m:
        return []
    return [f"Distillation gained {m['gain_points']:+.2f} points: the distilled student reaches {m['val_acc']:.2f}%, "
            f"the same student trained alone (same initialisation, schedule and seed) {m['baseline_val_acc']:.2f}%; "
            f"the teacher {m['teacher_val_acc']:.2f}%."]
