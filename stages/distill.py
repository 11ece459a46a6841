"""distill: train the small student from the frozen teacher - any weighted mix of cross-entropy, Hinton KD
on logits, cosine loss on hidden representations, and a FitNets hint through a trainable regressor."""

import logging
import time

import torch
import torch.nn.functional as F

from compress import dist
from compress.checkpoint import save_weights
from compress.context import Input, StageResult
from compress.data import eval_loader, load_data, train_loader
from compress.distillation import (
    FrozenTeacher,
    StudentWithRegressor,
    build_cache,
    probe_shapes,
)
from compress.losses import (
    cosine_loss,
    hint_loss,
    kd_loss,
    make_regressor,
    reduce_width,
)
from compress.models import build_model, count_parameters
from compress.report import file_size
from compress.train import build_optimizer, evaluate

log = logging.getLogger(__name__)

NAME = "distill"
SUMMARY = "train the small student from the frozen teacher (KD, cosine, hint)"
CONFIG_KEYS = ("seed", "data", "model.teacher", "model.student", "distill")
OUTPUTS = {"model": "distill/model.safetensors", "metrics": "distill/metrics.json"}
RANK0_ONLY = False


def inputs(cfg):
    return [Input("teacher", "model")]


def build_student(cfg, data, teacher):
    """Student (+ hint regressor) wired to the teacher's layers; shapes are checked before any training."""
    d = cfg.distill
    torch.manual_seed(cfg.seed)
    student = StudentWithRegressor(build_model(cfg.model.student, data.input_shape, data.num_classes),
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
    d = cfg.distill

    def loss_fn(batch):
        x, y = batch.x, batch.y
        logits, s_cosine, s_hint = ddp_student(x)
        t = cache.lookup(batch.index, device) if cache is not None else teacher(x)
        terms = {}
        if d.ce_weight:
            terms["ce"] = (d.ce_weight, F.cross_entropy(logits, y))
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
    teacher_model, _ = ctx.load_model(("teacher", "model"), cfg.model.teacher, data)
    teacher = FrozenTeacher(teacher_model, cosine_layer=d.cosine.teacher_layer if d.cosine.weight else None,
                            hint_layer=d.hint.teacher_layer if d.hint.weight else None)
    student = build_student(cfg, data, teacher).to(env.device)  # shapes probed on the CPU, then moved
    teacher.model.to(env.device)
    ctx.begin()
    ddp_student = dist.wrap_ddp(student, env)
    val = eval_loader(data.val, cfg.train.eval_batch_size, env.rank, env.world, cfg.train.num_workers)

    cache, cache_seconds = None, 0.0
    if d.cache_teacher and not cfg.data.augment:
        start = time.perf_counter()
        # the training batch size: large batches of a wide teacher run slower per image on a CPU
        cache = build_cache(teacher, data.train, env, d.batch_size)
        cache_seconds = time.perf_counter() - start
        if env.is_main:
            log.info("distill: cached teacher outputs for %d samples (%.1f MB) in %.1fs",
                     len(data.train), cache.nbytes() / 1e6, cache_seconds)
    batch = dist.per_rank_batch(d.batch_size, env, "distill.batch_size")
    loader = train_loader(data.train, batch, env.rank, env.world, cfg.seed, cfg.train.num_workers)
    modules = {"student": student.student}
    if student.regressor is not None:
        modules["regressor"] = student.regressor
    history = ctx.fit(ddp_student, modules=modules, optimizer=build_optimizer(student.parameters(), d), ocfg=d,
                      loader=loader, loss_fn=make_loss(cfg, ddp_student, teacher, cache, env.device),
                      evaluate_fn=lambda epoch: evaluate(student.student, val, env))
    mismatched = dist.replica_mismatches(env, student)
    dist.fail_if(env, mismatched, f"distill: ranks disagree on {len(mismatched)} tensors after training "
                 f"({', '.join(mismatched[:3])}); DDP went out of sync")
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["model"]), student.student,
                     ctx.weights_metadata(cfg.model.student, data, parent=ctx.input_sha256("teacher", "model")))
    teacher_acc = evaluate(teacher.model, val, env)["val_acc"]
    final = history[-1]
    metrics = {"val_acc": final["val_acc"], "val_loss": final["val_loss"], "teacher_val_acc": teacher_acc,
               "params": count_parameters(student.student), "teacher_params": count_parameters(teacher.model),
               "images_per_s": final["images_per_s"], "epochs": len(history), "replicas_identical": True,
               "teacher_cache": {"used": cache is not None, "seconds": round(cache_seconds, 2),
                                 "megabytes": round(cache.nbytes() / 1e6, 2) if cache else 0.0},
               "losses": [k for k, w in (("ce", d.ce_weight), ("kd", d.kd.weight), ("cosine", d.cosine.weight),
                                         ("hint", d.hint.weight)) if w]}
    return StageResult(metrics, list(OUTPUTS.values()),
                       f"student {cfg.model.student}: val acc {final['val_acc']:.2f}% (teacher {teacher_acc:.2f}%)")


def report_rows(entry, path):
    m = entry["metrics"]
    return [{"id": "student", "artifact": "student (PyTorch fp32)", "file": OUTPUTS["model"], "params": m["params"],
             "size_bytes": file_size(path("model")), "val_acc": m["val_acc"]}]
