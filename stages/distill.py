"""distill: train the small student from the frozen teacher - a weighted mix of cross-entropy, a logit loss
(Hinton KD, DKD, DIST or standardized KD), a cosine loss on hidden representations and a FitNets hint - on the
labelled images and, when `data.unlabeled` is set, on unlabelled images the teacher labels. Then the same
student is trained alone (cross-entropy, labelled images, the same views) so the report can say what
distilling gained.

The student sees fixed augmented views of each image (one per epoch by default); the teacher's outputs for
exactly those pixels come from the teacher-output store (`compress.distill.store`), built once and reused."""

import logging
import shlex

import torch

from compress.data.sampling import train_loader
from compress.distill import baseline, report
from compress.distill.feature_losses import FEATURE_LOSSES
from compress.distill.objective import describe_loss, loss_problems, make_loss
from compress.distill.store import fill_store, plan_store
from compress.distill.teacher import wire_features
from compress.fileio import atomic_write_json, sha256_file
from compress.models.registry import build_model, count_parameters
from compress.models.weights import load_pretrained, normalisation_note, weights_of
from compress.run.config import result_hash
from compress.run.contract import IMAGE_BYTES_DIGEST, Code, File, Images, Input, StageResult
from compress.run.report import evaluated_in, file_size
from compress.torchrun import run_command
from compress.training import distributed as dist
from compress.training.checkpoint import load_weights, save_weights
from compress.training.loop import evaluate, fit
from compress.training.losses import label_loss
from compress.training.schedule import Schedule, build_optimizer

log = logging.getLogger(__name__)

NAME = "distill"
SUMMARY = "train the small student from the frozen teacher (logit losses, cosine, hint; unlabelled images too)"
CONFIG_KEYS = ("seed", "data", "model.teacher", "model.student", "model.student_weights", "distill")
OUTPUTS = {"model": "distill/model.safetensors", "metrics": "distill/metrics.json",
           "baseline": "distill/baseline.safetensors", "baseline_metrics": "distill/baseline/metrics.json"}
PARTS = ("", "baseline")
RANK0_ONLY = False
STORE_FOLDER = "distill/teacher_outputs"
WRITES_TOO = (f"{STORE_FOLDER}/store.json",)  # files beside OUTPUTS, checked before the stage like them


def inputs(cfg):
    weights = weights_of(cfg.model, "student")
    return [Input("teacher", "model"), Images("root"), Code("model.teacher"), Code("model.student"),
            *([Images("unlabeled")] if cfg.data.unlabeled else []),
            *([File(weights, "model.student_weights")] if weights else [])]


def new_student(cfg, data):
    """The plain student: seeded initialisation, or the weights of model.student_weights."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.student, data.input_shape, data.num_classes)
    if cfg.model.student_weights:
        note = load_pretrained(model, weights_of(cfg.model, "student"), "model.student_weights", cfg.model.student)
        log.info("distill: %s%s", note, normalisation_note(cfg.model.student_weights, cfg.data))
    return model


def build_pair(cfg, data, teacher_model):
    """(student with its feature losses' adapters, frozen teacher), wired by layer name; the feature shapes are
    probed on one example and checked before any training."""
    return wire_features(cfg.distill, new_student(cfg, data), teacher_model, data.example())


def run(ctx):
    cfg, env, d = ctx.cfg, ctx.env, ctx.cfg.distill
    data = ctx.load_data(unlabeled=True)
    augmented = data.train.augment.active or d.mix != "none"
    labelled = data.train.with_augment(views=d.views_for(augmented), view_seed=d.view_seed, mix=d.mix,
                                       mix_alpha=d.mix_alpha)
    train_set = labelled.concat(data.unlabeled) if data.unlabeled is not None else labelled
    teacher_model, _ = ctx.load_model("teacher", cfg.model.teacher, data)
    student, teacher = build_pair(cfg, data, teacher_model)  # shapes probed on the CPU, then moved
    for model in (student, teacher.model):
        model.to(env.device)
    precision = ctx.precision([student, teacher.model], data.train.batch([0]).x, trained=[student])
    loader, val = ctx.loaders(train_set, data.val, d.batch_size, "distill.batch_size")
    store, plan = plan_store(ctx.run.path(STORE_FOLDER), env, d, ctx.input_sha256("teacher", "model"),
                             cfg.model.teacher, teacher, train_set, data.num_classes, precision,
                             teacher_code=ctx.state.inputs.get(Code("model.teacher").input_key, ""))
    teacher_acc = evaluate(teacher.model, val, env, precision)["val_acc"]
    _warn_if_near_chance(env, "the teacher", teacher_acc, data.num_classes,
                         "distilling from it cannot help; train it longer (teacher.epochs) and rerun")
    ctx.begin()
    views = d.views_for(augmented)
    if env.is_main and d.views and views < d.views:
        log.info("distill: %d of distill.views=%d view(s) per image are used: %s", views, d.views,
                 "without augmentation every view is the same image" if not augmented else
                 f"{d.epochs} epoch(s) show {views} (a longer run adds the others to the store)")
    teacher_outputs = fill_store(store, plan, teacher, train_set, env, d.batch_size, precision, STORE_FOLDER)
    ddp_student = dist.wrap_ddp(student, env)
    modules = {"student": student.student, **student.adapters}
    optimizer = build_optimizer(student.parameters(), d)
    schedule = Schedule.from_config(d, loader.sampler.batches_per_epoch)
    session = ctx.session(modules, optimizer, schedule.steps_per_epoch, d.epochs, precision=precision)
    log.info("distill: loss = %s", describe_loss(d))
    for problem in loss_problems(d):
        log.warning("distill: %s", problem)
    history = fit(ddp_student, make_loss(d, ddp_student, teacher, store, schedule.steps_per_epoch), optimizer, loader,
                  schedule, lambda epoch: evaluate(student.student, val, env, precision), session)
    _warn_if_near_chance(env, "the distilled student", history[-1]["val_acc"], data.num_classes,
                         "train it longer (distill.epochs) or more gently (a lower distill.lr), and check that "
                         "model.student suits images of data.image_size pixels")
    replicas = dist.check_replicas(env, student, "distill")
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["model"]), student.student,
                     ctx.weights_metadata(cfg.model.student, data, parent=ctx.input_sha256("teacher", "model")))
    baseline = _train_baseline(ctx, data, labelled, val, precision) if d.baseline else None
    below = report.teacher_below_alone(teacher_acc, baseline[-1]["val_acc"], len(data.val)) if baseline else ""
    if below and env.is_main:
        log.warning("distill: %s", below)
    result = _result(cfg, history, baseline, teacher_acc, student, teacher, replicas, precision, teacher_outputs,
                     labelled, len(train_set) - len(labelled))
    if baseline:  # is the gain beyond noise on these images? the exact McNemar test, as export does for QAT vs PTQ
        result.metrics.update(_paired_students(ctx, data, val, precision, student.student))
        better = report.alone_better(result.metrics, f"{run_command()} --run-dir {shlex.quote(str(ctx.run.root))}")
        if env.is_main and better:
            log.warning("distill: %s", better)
    result.metrics["peak_rss_mb"] = dist.peak_rss_mb(env)  # per process: the store is memory-mapped, not copied
    return result


def _paired_students(ctx, data, val, precision, student):
    """The distilled student against the student alone, image by image on the validation images."""
    dist.barrier(ctx.env)  # rank 0 has written the student alone's file
    alone = build_model(ctx.cfg.model.student, data.input_shape, data.num_classes)
    load_weights(alone, ctx.run.path(OUTPUTS["baseline"]))
    alone = alone.to(ctx.env.device)
    return report.paired_students(ctx.env, val, (student, precision),
                                  (alone, precision.place([alone], data.val.batch([0]).x)))


def _warn_if_near_chance(env, who, accuracy, classes, advice):
    """One line when a model is barely above chance: within a tenth of the way from chance to 100%."""
    chance = 100.0 / classes
    if env.is_main and accuracy < chance + (100.0 - chance) / 10:
        log.warning("distill: %s scores %.2f%% on the validation images, hardly better than chance (%.1f%% for %d "
                    "classes): %s", who, accuracy, chance, classes, advice)


# What the student trained alone depends on: not the teacher, the distillation losses, the store or the
# unlabelled images. A rerun that changes only those (another teacher, another logit loss) reuses it.
BASELINE_KEYS = ("seed", "data", "-data.unlabeled", "model.student", "model.student_weights", "distill",
                 "-distill.kd", *(f"-distill.{name}" for name in FEATURE_LOSSES), "-distill.ce_weight",
                 "-distill.store", "-distill.baseline")


def baseline_made_with(ctx, data, labelled, precision):
    """Everything the student alone's training and its validation figures depend on (compress.distill.baseline):
    its config, its initial weights file, the labelled and validation images, the precision and memory layout,
    the processes and threads (CPU results are bit-identical only at the same thread count)."""
    student_inputs = {k: v for k, v in ctx.state.inputs.items()  # not the teacher, nor the unlabelled images
                      if not k.startswith(("teacher/", IMAGE_BYTES_DIGEST))  # (bytes: the fingerprints below)
                      and k not in (Images("unlabeled").input_key, Code("model.teacher").input_key)}
    clip = ctx.cfg.train.clip_grad_norm  # a part only when set: students alone trained unclipped keep their key
    return {"config": result_hash(ctx.cfg, BASELINE_KEYS, images_followed=False), "weights": student_inputs,
            "images": labelled.fingerprint(), "val": data.val.fingerprint(),
            "precision": [precision.name, precision.layout], "world": ctx.env.world,
            "device": ctx.env.device.type, "threads": torch.get_num_threads(),
            **({"clip_grad_norm": clip} if clip is not None else {})}


def _train_baseline(ctx, data, labelled, val, precision):
    """The same student trained alone (compress.distill.baseline) - or the one an earlier run trained, when
    nothing it depends on changed."""
    cfg, env, d = ctx.cfg, ctx.env, ctx.cfg.distill
    made_with = dist.on_main(env, baseline_made_with, ctx, data, labelled, precision)
    reused = None if ctx.state.reason == "--force" else dist.on_main(
        env, baseline.finished, ctx.run.path(OUTPUTS["baseline_metrics"]), ctx.run.path(OUTPUTS["baseline"]),
        made_with, d.epochs)
    if reused:
        if env.is_main:
            log.info("distill: the student alone is the one an earlier run trained (%.2f%%): nothing it depends on "
                     "changed (the teacher and the distillation losses are not among it)", reused[-1]["val_acc"])
        return reused
    model = new_student(cfg, data).to(env.device)
    precision = precision.place([model], data.train.batch([0]).x)
    ddp_model = dist.wrap_ddp(model, env)
    loader = train_loader(labelled, dist.per_rank_batch(d.batch_size, env, "distill.batch_size"), env.rank, env.world,
                          cfg.seed, ctx.workers, env.device.type == "cuda")
    optimizer = build_optimizer(model.parameters(), d)
    schedule = Schedule.from_config(d, loader.sampler.batches_per_epoch)
    session = ctx.session({"student": model}, optimizer, schedule.steps_per_epoch, d.epochs, part="baseline",
                          precision=precision)

    def loss_fn(batch, step):
        return label_loss(ddp_model(batch.x), batch, d.label_smoothing), {}

    history = fit(ddp_model, loss_fn, optimizer, loader, schedule, lambda epoch: evaluate(model, val, env, precision),
                  session)
    if env.is_main:
        key = baseline.key_of(made_with)
        save_weights(ctx.run.path(OUTPUTS["baseline"]), model,
                     {**ctx.weights_metadata(cfg.model.student, data), "role": "baseline: trained alone, CE only",
                      "baseline_key": key})
        atomic_write_json(ctx.run.path(OUTPUTS["baseline_metrics"]),
                          {"stage": "distill baseline", "epochs": history, "baseline_key": key,
                           "made_with": made_with, "sha256": sha256_file(ctx.run.path(OUTPUTS["baseline"]))})
    return history


def _result(cfg, history, baseline_history, teacher_acc, student, teacher, replicas, precision, teacher_outputs,
            labelled, unlabelled):  # noqa: PLR0913 - the figures the stage reports, gathered in one place
    d, final = cfg.distill, history[-1]
    metrics = {"val_acc": final["val_acc"], "val_loss": final["val_loss"], "teacher_val_acc": teacher_acc,
               "params": count_parameters(student.student), "teacher_params": count_parameters(teacher.model),
               "images_per_s": final["images_per_s"], "epochs": d.epochs, "replicas_identical": replicas,
               **precision.describe(), "teacher_outputs": teacher_outputs, "kd_method": d.kd.method,
               "kd_temperature": d.kd.resolved_temperature, "kd_weight": d.kd.resolved_weight,
               "ce_weight": d.resolved_ce_weight, "views": labelled.augment.views, "mix": d.mix,
               "labelled_images": len(labelled), "unlabelled_images": unlabelled,
               "losses": [term for term, weight in d.loss_weights().items() if weight]}
    summary = f"student {cfg.model.student}: val acc {final['val_acc']:.2f}% (teacher {teacher_acc:.2f}%)"
    outputs = [OUTPUTS["model"], OUTPUTS["metrics"]]
    if baseline_history:
        alone = baseline_history[-1]["val_acc"]
        metrics.update(baseline_val_acc=alone, gain_points=round(final["val_acc"] - alone, 4),
                       epoch_passing_alone=report.epoch_passing(history, alone))
        summary += f"; trained alone {alone:.2f}% ({metrics['gain_points']:+.2f} points from distilling)"
        outputs += [OUTPUTS["baseline"], OUTPUTS["baseline_metrics"]]
    return StageResult(metrics, outputs, summary)


def report_rows(entry, path):
    m = entry["metrics"]
    rows = [{"id": "student", "artifact": f"student, distilled ({evaluated_in(m)})", "file": OUTPUTS["model"],
             "params": m["params"], "size_bytes": file_size(path("model")), "val_acc": m["val_acc"]}]
    if "baseline_val_acc" in m:
        rows.append({"id": "baseline", "artifact": f"student alone, no teacher ({evaluated_in(m)})",
                     "file": OUTPUTS["baseline"], "params": m["params"], "size_bytes": file_size(path("baseline")),
                     "val_acc": m["baseline_val_acc"]})
    return rows


def report_notes(entry, manifest=None, refresh="compress run"):
    """What distilling gained, and - when the student alone is the better one - whether it is the one shipped
    (qat.source: baseline in the qat stage that ran) or the command that ships it."""
    m = entry["metrics"]
    qat = ((manifest or {}).get("stages") or {}).get("qat") or {}
    shipped = qat.get("status") == "complete" and ((qat.get("config") or {}).get("qat") or {}).get("source")
    return report.gain_notes(m, report.losses_label(m), refresh, alone_shipped=shipped == "baseline")

