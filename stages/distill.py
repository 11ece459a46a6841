"""distill: train the small student from the frozen teacher - a weighted mix of cross-entropy, a logit loss
(Hinton KD, DKD, DIST or standardized KD), a cosine loss on hidden representations and a FitNets hint - on the
labelled images and, when `data.unlabeled` is set, on unlabelled images the teacher labels. Then the same
student is trained alone (cross-entropy, labelled images, the same views) so the report can say what
distilling gained.

The student sees fixed augmented views of each image (one per epoch by default); the teacher's outputs for
exactly those pixels come from the teacher-output store (`compress.distill.store`), built once and reused."""

import hashlib
import json
import logging
import math
import time

import torch

from compress.data.sampling import train_loader
from compress.distill.feature_losses import cosine_loss, hint_loss
from compress.distill.logit_losses import logit_loss
from compress.distill.store import StoreSpec, TeacherOutputStore, default_top_k
from compress.distill.teacher import FrozenTeacher, StudentWithRegressor, wire_features
from compress.errors import CompressError
from compress.fileio import atomic_write_json, read_json, sha256_file
from compress.models.registry import build_model, count_parameters
from compress.models.weights import load_pretrained, weights_of
from compress.run.config import PAPER_SETTINGS, section_hash
from compress.run.contract import DIGESTS, Code, File, Images, Input, StageResult
from compress.run.report import evaluated_in, file_size
from compress.training import distributed as dist
from compress.training.checkpoint import load_weights, read_weights, save_weights
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
        log.info("distill: %s", load_pretrained(model, weights_of(cfg.model, "student"), "model.student_weights"))
    return model


def build_pair(cfg, data, teacher_model):
    """(student with its hint regressor, frozen teacher), wired by layer name; the feature shapes are probed on
    one example and checked before any training."""
    student_model = new_student(cfg, data)
    s_cos, s_hint, t_cos, t_hint, width, regressor = wire_features(cfg.distill, student_model, teacher_model,
                                                                   data.example())
    return (StudentWithRegressor(student_model, s_cos, s_hint, regressor),
            FrozenTeacher(teacher_model, t_cos, t_hint, width))


def kd_target(batch, teacher_logits):
    """The class DKD treats as the target: the label of the image's larger share (itself, or its mixing
    partner), or the teacher's top class where that has no label."""
    y = torch.where(batch.own >= 0.5, batch.y, batch.partner_y)
    return torch.where(y >= 0, y, teacher_logits.argmax(1))


def make_loss(d, student, teacher, store, steps_per_epoch):
    """loss_fn(batch, step) -> (total, {term: value}): the weighted sum of the terms whose weight is not 0. The
    teacher's outputs come from the store (by sample and view) or from running the frozen teacher on the very
    batch the student sees. DKD's weight rises linearly over its first distill.kd.dkd.warmup_epochs."""
    kd = d.kd
    params = {"dkd": {"alpha": kd.dkd.alpha, "beta": kd.dkd.beta},
              "dist": {"beta": kd.dist.beta, "gamma": kd.dist.gamma}}.get(kd.method, {})
    warmup = kd.dkd.warmup_epochs * steps_per_epoch if kd.method == "dkd" else 0
    weights = d.loss_weights()
    needs_teacher = bool(weights["kd"] or weights["cosine"] or weights["hint"])

    def loss_fn(batch, step):
        logits, s_cosine, s_hint = student(batch.x)
        t = None
        if needs_teacher:
            t = store.lookup(batch.index, batch.view, logits.device) if store is not None else teacher(batch.x)
        terms = {}
        if weights["ce"]:
            terms["ce"] = (weights["ce"], label_loss(logits, batch, d.label_smoothing))
        if weights["kd"]:
            ramp = min((step + 1) / warmup, 1.0) if warmup else 1.0
            t_logits = t["logits"].float()
            kd_value = logit_loss(kd.method, logits.float(), t_logits, kd_target(batch, t_logits),
                                  kd.resolved_temperature, params)
            terms["kd"] = (weights["kd"] * ramp, kd_value)
        if weights["cosine"]:
            terms["cosine"] = (weights["cosine"], cosine_loss(s_cosine.float(), t["cosine"].float()))
        if weights["hint"]:
            terms["hint"] = (weights["hint"], hint_loss(s_hint.float(), t["hint"].float()))
        total = sum(w * value for w, value in terms.values())
        return total, {k: value.item() for k, (_, value) in terms.items()}

    return loss_fn


KD_NAMES = {"hinton": "Hinton KD", "dkd": "DKD", "dist": "DIST", "standardized": "standardized-logit KD"}


def describe_loss(d):
    """The loss in words, as the log shows it: '0.1 x cross-entropy + 9 x standardized-logit KD (T 2); ce_weight,
    kd.weight, kd.temperature: the standardized-logit KD paper's values' (the last part names what was left at null)."""
    kd, w = d.kd, d.loss_weights()
    names = {"ce": "cross-entropy", "kd": f"{KD_NAMES[kd.method]} (T {kd.resolved_temperature:g})",
             "cosine": f"cosine loss (teacher {d.cosine.teacher_layer}, student {d.cosine.student_layer})",
             "hint": f"FitNets hint (teacher {d.hint.teacher_layer}, student {d.hint.student_layer})"}
    text = " + ".join(f"{w[term]:g} x {name}" for term, name in names.items() if w[term])
    defaulted = [k for k, v in (("ce_weight", d.ce_weight), ("kd.weight", kd.weight), ("kd.temperature",
                                                                                      kd.temperature)) if v is None]
    paper = PAPER_SETTINGS[kd.method]
    own = [f"{key} {value:g} (paper {paper[name]:g})" for key, name, value in (
        ("ce_weight", "ce_weight", d.ce_weight), ("kd.weight", "weight", kd.weight),
        ("kd.temperature", "temperature", kd.temperature)) if value is not None and value != paper[name]]
    if not w["kd"]:
        return text
    return (text + (f"; {', '.join(defaulted)}: the {KD_NAMES[kd.method]} paper's values" if defaulted else "")
            + (f"; set by the config, not the {KD_NAMES[kd.method]} paper's: {', '.join(own)} (null takes the "
               "paper's; a recipe's values stay when only distill.kd.method changes)" if own else ""))


def _loss_problems(d):
    """Settings that quietly make distillation something else (the second fresh-user pass)."""
    w, found = d.loss_weights(), []
    if not any(w[term] for term in ("kd", "cosine", "hint")):
        found.append("no loss here learns from the teacher (distill.kd.weight 0, no cosine or hint loss): the student "
                     "trains on the labels alone, and the gain the report states is not distillation's")
    elif d.kd.method == "dkd" and w["kd"] and d.kd.dkd.warmup_epochs > d.epochs:
        found.append(f"DKD's weight rises over distill.kd.dkd.warmup_epochs={d.kd.dkd.warmup_epochs:g} epochs, longer "
                     f"than distill.epochs={d.epochs}: it reaches only {d.epochs / d.kd.dkd.warmup_epochs:.0%} of "
                     f"its weight; lower the warm-up (e.g. --set distill.kd.dkd.warmup_epochs={max(1, d.epochs // 4)})")
    return found


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
    precision = ctx.precision([student, teacher.model], data.train.batch([0]).x)
    loader, val = ctx.loaders(train_set, data.val, d.batch_size, "distill.batch_size")
    store, plan = _plan_store(ctx, teacher, train_set, data, precision)
    teacher_acc = evaluate(teacher.model, val, env, precision)["val_acc"]
    _warn_if_near_chance(env, "the teacher", teacher_acc, data.num_classes,
                         "distilling from it cannot help; train it longer (teacher.epochs) and rerun")
    ctx.begin()
    teacher_outputs = _fill_store(ctx, store, plan, teacher, train_set, precision)
    ddp_student = dist.wrap_ddp(student, env)
    modules = {"student": student.student, **({"regressor": student.regressor} if student.regressor else {})}
    optimizer = build_optimizer(student.parameters(), d)
    schedule = Schedule.from_config(d, loader.sampler.batches_per_epoch)
    session = ctx.session(modules, optimizer, schedule.steps_per_epoch, d.epochs, precision=precision)
    log.info("distill: loss = %s", describe_loss(d))
    for problem in _loss_problems(d):
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
    if baseline and env.is_main and teacher_acc < baseline[-1]["val_acc"]:
        log.warning("distill: the teacher (%.2f%%) is below the student trained alone (%.2f%%): it has less to teach "
                    "than the labels; a stronger teacher (more teacher.epochs, a larger model.teacher) will help more "
                    "than any distillation setting", teacher_acc, baseline[-1]["val_acc"])
    result = _result(cfg, history, baseline, teacher_acc, student, teacher, replicas, precision, teacher_outputs,
                     labelled, len(train_set) - len(labelled))
    if baseline:  # is the gain beyond noise on these images? the exact McNemar test, as export does for QAT vs PTQ
        result.metrics.update(_paired_students(ctx, data, val, precision, student.student))
    result.metrics["peak_rss_mb"] = dist.peak_rss_mb(env)  # per process: the store is memory-mapped, not copied
    return result


def _paired_students(ctx, data, val, precision, student):
    """The distilled student against the student alone, image by image on the validation images - on every rank,
    its share of them through the loader and precision that gave the reported accuracies, the counts summed: how
    many each alone gets right, and the McNemar p of that."""
    from compress.quant.verify import mcnemar_p

    env = ctx.env
    dist.barrier(env)  # rank 0 has written the student alone's file
    alone = build_model(ctx.cfg.model.student, data.input_shape, data.num_classes)
    load_weights(alone, ctx.run.path(OUTPUTS["baseline"]))
    alone = alone.to(env.device).eval()
    placed = precision.place([alone], data.val.batch([0]).x)
    student.eval()
    counts = torch.zeros(3, dtype=torch.float64)  # right only distilled, right only alone, images
    with torch.no_grad():
        for batch in val:
            y = batch.y.to(env.device)
            with precision.autocast():
                first = student(precision.inputs(batch.x, env.device)).float().argmax(1) == y
            with placed.autocast():
                second = alone(placed.inputs(batch.x, env.device)).float().argmax(1) == y
            counts += torch.tensor([(first & ~second).sum().item(), (second & ~first).sum().item(), len(y)],
                                   dtype=torch.float64)
    only_first, only_second, images = (int(v) for v in dist.all_reduce(env, counts).tolist())
    return {"val_images": images, "distilled_only_right": only_first, "alone_only_right": only_second,
            "gain_p": mcnemar_p(only_first, only_second)}


def _warn_if_near_chance(env, who, accuracy, classes, advice):
    """One line when a model is barely above chance: within a tenth of the way from chance to 100%."""
    chance = 100.0 / classes
    if env.is_main and accuracy < chance + (100.0 - chance) / 10:
        log.warning("distill: %s scores %.2f%% on the validation images, hardly better than chance (%.1f%% for %d "
                    "classes): %s", who, accuracy, chance, classes, advice)


def _plan_store(ctx, teacher, train_set, data, precision):
    """(store, plan) when the teacher's outputs are stored, else (None, why not). Checked before anything is
    written: a store that would not fit on the disk is refused here, with the numbers."""
    cfg, env, d = ctx.cfg, ctx.env, ctx.cfg.distill
    if not d.store.enabled:
        return None, "distill.store.enabled is false"
    if d.hint.weight:
        return None, ("the hint loss needs the teacher's feature maps, which the store does not keep (kilobytes per "
                      "image)")
    if not (d.loss_weights()["kd"] or d.cosine.weight):
        return None, "no loss needs the teacher"
    a = train_set.augment
    spec = StoreSpec(
        teacher_sha256=ctx.input_sha256("teacher", "model"), teacher_model=cfg.model.teacher,
        data_fingerprint=train_set.fingerprint(), samples=len(train_set), views=a.views, classes=data.num_classes,
        top_k=default_top_k(data.num_classes, d.store.top_k),
        augment={"kind": a.kind, "flip": a.flip, "padding": a.padding, "scale": list(a.scale),
                 "view_seed": a.view_seed, "mix": a.mix, "mix_alpha": a.mix_alpha},
        precision=precision.name, cosine_layer=teacher.cosine_layer or "", cosine_width=teacher.cosine_width or 0)
    store = TeacherOutputStore(ctx.run.path(STORE_FOLDER), spec)
    plan = store.prepare(env)
    dist.on_main(env, store.check_disk, plan["missing"])
    return store, plan


def _fill_store(ctx, store, plan, teacher, train_set, precision):
    """Build what the store lacks (or nothing), open it, and return what it cost for the metrics."""
    env, d = ctx.env, ctx.cfg.distill
    if store is None:
        if env.is_main:
            log.info("distill: the teacher runs on every batch (%s)", plan)
        return {"mode": "teacher on every batch", "why": plan}
    s = store.spec
    if env.is_main:
        what = (f"{s.views} view(s) x {s.samples:,} images, {s.bytes_per_row()} bytes each "
                f"({'all' if s.dense else f'top {s.top_k} of'} {s.classes} logits), {s.total_bytes() / 1e6:.1f} MB")
        verb = {"reuse": "reusing", "resume": "resuming the build of", "build": "building", "extend": "extending",
                "rebuild": "rebuilding"}[plan["status"]]
        log.info("distill: teacher outputs: %s the store in %s: %s (%s)", verb, STORE_FOLDER, what, plan["reason"])
    start = time.perf_counter()
    if plan["missing"]:
        store.build(teacher, train_set, env, d.batch_size, lambda x: precision.inputs(x, env.device), plan,
                    precision.autocast)
        if env.is_main:
            log.info("distill: teacher outputs for %d chunk(s) computed in %.1fs", len(plan["missing"]),
                     time.perf_counter() - start)
    store.open()
    return store.describe(plan, time.perf_counter() - start)


# What the student trained alone depends on: not the teacher, the distillation losses, the store or the
# unlabelled images. A rerun that changes only those (another teacher, another logit loss) reuses it.
BASELINE_KEYS = ("seed", "data", "-data.unlabeled", "model.student", "model.student_weights", "distill",
                 "-distill.kd", "-distill.cosine", "-distill.hint", "-distill.ce_weight", "-distill.store",
                 "-distill.baseline")


def baseline_key(ctx, data, labelled, precision):
    """A hash of everything the student alone's training and its validation figures depend on: its config, its
    initial weights file, the labelled and validation images, the precision and memory layout, the processes and
    threads (CPU results are bit-identical only at the same thread count). Returns (key, the parts it hashes)."""
    weights = {k: v for k, v in ctx.state.inputs.items()  # not the teacher, nor the unlabelled images it never sees
               if not k.startswith(("teacher/", f"{DIGESTS[0]} data.unlabeled", f"{DIGESTS[1]} model.teacher"))}
    made_with = {"config": section_hash(ctx.cfg, BASELINE_KEYS), "weights": weights,
                 "images": labelled.fingerprint(), "val": data.val.fingerprint(),
                 "precision": [precision.name, precision.layout], "world": ctx.env.world,
                 "device": ctx.env.device.type, "threads": torch.get_num_threads()}
    return hashlib.sha256(json.dumps(made_with, sort_keys=True).encode()).hexdigest()[:16], made_with


BASELINE_PARTS = {"config": "its config (distill settings other than the losses, data, model.student)",
                  "weights": "model.student_weights, the labelled images' listing or model.student's code",
                  "images": "the labelled images",
                  "val": "the validation images", "precision": "the precision or memory layout",
                  "world": "the number of processes", "device": "the device",
                  "threads": "the thread count (CPU results are reproducible only at the same one)"}


def _why_again(saved, made_with):
    """Why an earlier run's student alone cannot be reused, in words ('' when nothing says)."""
    before = saved.get("made_with") if isinstance(saved, dict) else None
    if not isinstance(before, dict):
        return ""
    changed = [BASELINE_PARTS[k] for k in BASELINE_PARTS if before.get(k) != made_with.get(k)]
    return f"{', '.join(changed)} changed since" if changed else ""


def _finished_baseline(ctx, key, made_with):
    """The per-epoch history of a student alone an earlier run trained with the same `key`, or None: not with
    --force, and only when its weights file is the one that run wrote (checked by sha256). Says why it is not
    reused when an earlier one is there."""
    if ctx.state.reason == "--force":
        return None
    try:
        saved = read_json(ctx.run.path(OUTPUTS["baseline_metrics"]), "the student alone's metrics")
        why = _why_again(saved, made_with) if isinstance(saved, dict) and saved.get("baseline_key") != key else ""
        if why:
            log.info("distill: training the student alone again: %s", why)
        if not isinstance(saved, dict) or saved.get("baseline_key") != key or not isinstance(saved.get("sha256"), str):
            return None
        _, meta = read_weights(ctx.run.path(OUTPUTS["baseline"]), expect_sha256=saved["sha256"])
    except CompressError:
        return None
    history = saved.get("epochs")
    if meta.get("baseline_key") != key or not isinstance(history, list) or len(history) != ctx.cfg.distill.epochs \
            or not all(isinstance(h, dict) and isinstance(h.get("epoch"), int) and
                       isinstance(h.get("val_acc"), (int, float)) for h in history):
        return None
    return history


def _train_baseline(ctx, data, labelled, val, precision):
    """The same student trained alone - cross-entropy only, same initialisation, schedule, seed and augmented
    views, on the labelled images only (it has no labels for the rest) - so the run states what distilling
    gained. An earlier run's student alone is reused when nothing it depends on changed."""
    cfg, env, d = ctx.cfg, ctx.env, ctx.cfg.distill
    key, made_with = dist.on_main(env, baseline_key, ctx, data, labelled, precision)
    reused = dist.on_main(env, _finished_baseline, ctx, key, made_with)
    if reused:
        if env.is_main:
            log.info("distill: the student alone is the one an earlier run trained (%.2f%%): nothing it depends on "
                     "changed (the teacher and the distillation losses are not among it)", reused[-1]["val_acc"])
        return reused
    model = new_student(cfg, data).to(env.device)
    precision = precision.place([model], data.train.batch([0]).x)
    ddp_model = dist.wrap_ddp(model, env)
    loader = train_loader(labelled, dist.per_rank_batch(d.batch_size, env, "distill.batch_size"), env.rank, env.world,
                          cfg.seed, cfg.train.num_workers, env.device.type == "cuda")
    optimizer = build_optimizer(model.parameters(), d)
    schedule = Schedule.from_config(d, loader.sampler.batches_per_epoch)
    session = ctx.session({"student": model}, optimizer, schedule.steps_per_epoch, d.epochs, part="baseline",
                          precision=precision)

    def loss_fn(batch, step):
        return label_loss(ddp_model(batch.x), batch, d.label_smoothing), {}

    history = fit(ddp_model, loss_fn, optimizer, loader, schedule, lambda epoch: evaluate(model, val, env, precision),
                  session)
    if env.is_main:
        save_weights(ctx.run.path(OUTPUTS["baseline"]), model,
                     {**ctx.weights_metadata(cfg.model.student, data), "role": "baseline: trained alone, CE only",
                      "baseline_key": key})
        atomic_write_json(ctx.run.path(OUTPUTS["baseline_metrics"]),
                          {"stage": "distill baseline", "epochs": history, "baseline_key": key,
                           "made_with": made_with, "sha256": sha256_file(ctx.run.path(OUTPUTS["baseline"]))})
    return history


def epoch_passing(history, accuracy):
    """The epoch (1-based) from which the validation accuracy stays at or above `accuracy` to the end, or None:
    not the first crossing, which a noisy epoch can make early."""
    passing = None
    for h in history:
        if h["val_acc"] < accuracy:
            passing = None
        elif passing is None:
            passing = h["epoch"]
    return passing


def _result(cfg, history, baseline, teacher_acc, student, teacher, replicas, precision, teacher_outputs, labelled,
            unlabelled):  # noqa: PLR0913 - the figures the stage reports, gathered in one place
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
    if baseline:
        alone = baseline[-1]["val_acc"]
        # the gain in training time, read from this run: from which epoch of the same schedule on the distilled
        # student stayed as good as the student alone ended
        metrics.update(baseline_val_acc=alone, gain_points=round(final["val_acc"] - alone, 4),
                       epoch_passing_alone=epoch_passing(history, alone))
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


def report_notes(entry):
    m = entry["metrics"]
    if "baseline_val_acc" not in m:
        return []
    method = KD_NAMES.get(m.get("kd_method"), "distillation")
    extra, same = "", "same initialisation, schedule, seed and augmented views"
    if m.get("unlabelled_images"):
        ratio = (m["labelled_images"] + m["unlabelled_images"]) / m["labelled_images"]
        same = "same initialisation, seed, augmented views and number of epochs"
        extra = (f" The distilled student also learned from {m['unlabelled_images']:,} unlabelled images through the "
                 f"teacher; the student trained alone saw only the {m['labelled_images']:,} labelled ones, so each of "
                 f"its epochs was {ratio:.1f}x fewer optimizer steps: part of the gain is that extra training. The "
                 f"student alone trained for {math.ceil(m['epochs'] * ratio)} epochs would take as many steps; "
                 f"compare with it before crediting the teacher with all of the gain.")
    if m.get("mix", "none") != "none":  # the same augmentation for both, but mixing can handicap the one alone
        extra += (f" Both students trained on {m['mix']}-mixed images, which can cost a student trained alone points "
                  f"of its own: the student alone of a run with distill.mix=none is the one to beat.")
    return [f"Distillation ({method}) gained {m['gain_points']:+.2f} points: the distilled student reaches "
            f"{m['val_acc']:.2f}%, the same student trained alone ({same}) {m['baseline_val_acc']:.2f}%; the teacher "
            f"{m['teacher_val_acc']:.2f}%.{_noise(m)}{'' if m.get('unlabelled_images') else _time_gain(m)}{extra}"]


def _noise(m):
    """Whether the two students differ beyond chance on these validation images (not across seeds)."""
    if "gain_p" not in m:  # a run from before this was measured
        return ""
    from compress.quant.verify import p_text

    told = (f" Of {m['val_images']:,} validation images, {m['distilled_only_right']:,} are right only with the "
            f"distilled student and {m['alone_only_right']:,} only with the student alone (McNemar p "
            f"{p_text(m['gain_p'])})")
    if m["gain_p"] < 0.05:
        return told + ": a difference beyond noise on these images (another seed still moves each student a little)."
    return (told + ": within noise - these images cannot tell the two apart; more validation images, or runs with "
            "other seeds, would.")


def _time_gain(m):
    """From which epoch on the distilled student stayed at or above the student alone's final accuracy."""
    epoch, epochs = m.get("epoch_passing_alone"), m.get("epochs")
    if not epoch or not epochs or m["gain_points"] <= 0:
        return ""
    if epoch == epochs:
        return " It reached the student alone's final accuracy only at its last epoch."
    return (f" From epoch {epoch} of {epochs} on ({epoch / epochs:.0%} of the way through the same learning-rate "
            f"schedule) it stayed at or above the student alone's final accuracy.")
