"""What the distill stage minimises: the weighted sum of cross-entropy on the labels, a logit loss from the
registry (`logit_losses.LOGIT_LOSSES`) and the feature losses (`feature_losses.FEATURE_LOSSES`), each term on
only when its weight is not 0 - and the same in words, for the log, with the settings that would quietly make
it something else than distillation."""

import torch

from compress.distill.feature_losses import FEATURE_LOSSES
from compress.training.losses import label_loss


def kd_target(batch, teacher_logits):
    """The class DKD treats as the target: the label of the image's larger share (itself, or its mixing
    partner), or the teacher's top class where that has no label."""
    y = torch.where(batch.own >= 0.5, batch.y, batch.partner_y)
    return torch.where(y >= 0, y, teacher_logits.argmax(1))


def make_loss(d, student, teacher, store, steps_per_epoch):
    """loss_fn(batch, step) -> (total, {term: value}) for the distill config `d`. The teacher's outputs come from
    the store (by sample and view) or from running the frozen teacher on the very batch the student sees. A
    logit loss with a warm-up (DKD) has its weight rise linearly over its first warm-up epochs."""
    kd, weights = d.kd, d.loss_weights()
    warmup = kd.params.get("warmup_epochs", 0) * steps_per_epoch
    needs_teacher = any(weights[term] for term in ("kd", *FEATURE_LOSSES))

    def loss_fn(batch, step):
        logits, features = student(batch.x)
        t = None
        if needs_teacher:
            t = store.lookup(batch.index, batch.view, logits.device) if store is not None else teacher(batch.x)
        terms = {}
        if weights["ce"]:
            terms["ce"] = (weights["ce"], label_loss(logits, batch, d.label_smoothing))
        if weights["kd"]:
            ramp = min((step + 1) / warmup, 1.0) if warmup else 1.0
            t_logits = t["logits"].float()
            value = kd.loss.fn(logits.float(), t_logits, kd_target(batch, t_logits), kd.resolved_temperature,
                               kd.params)
            terms["kd"] = (weights["kd"] * ramp, value)
        for name, mine in features.items():  # the feature losses the student was wired for: those with a weight
            terms[name] = (weights[name], FEATURE_LOSSES[name].fn(mine.float(), t[name].float()))
        total = sum(w * value for w, value in terms.values())
        return total, {k: value.item() for k, (_, value) in terms.items()}

    return loss_fn


def describe_loss(d):
    """The loss in words, as the log shows it: '0.1 x cross-entropy + 9 x standardized-logit KD (T 2); ce_weight,
    kd.weight, kd.temperature: the standardized-logit KD paper's values' (the last part names what was left at
    null, and what the config set apart from the paper's values)."""
    kd, w = d.kd, d.loss_weights()
    label = kd.loss.label
    names = {"ce": "cross-entropy", "kd": f"{label} (T {kd.resolved_temperature:g})",
             **{name: f"{loss.label} (teacher {getattr(d, name).teacher_layer}, student "
                      f"{getattr(d, name).student_layer})" for name, loss in FEATURE_LOSSES.items()}}
    text = " + ".join(f"{w[term]:g} x {name}" for term, name in names.items() if w[term])
    if not w["kd"]:
        return text
    settings = (("ce_weight", "ce_weight", d.ce_weight), ("kd.weight", "weight", kd.weight),
                ("kd.temperature", "temperature", kd.temperature))
    defaulted = [key for key, _, value in settings if value is None]
    own = [f"{key} {value:g} (paper {kd.loss.paper[name]:g})" for key, name, value in settings
           if value is not None and value != kd.loss.paper[name]]
    return (text + (f"; {', '.join(defaulted)}: the {label} paper's values" if defaulted else "")
            + (f"; set by the config, not the {label} paper's: {', '.join(own)} (null takes the paper's; a recipe's "
               "values stay when only distill.kd.method changes)" if own else ""))


def loss_problems(d):
    """Settings that quietly make distillation something else, in words (warned about in the log)."""
    w, found = d.loss_weights(), []
    if not any(w[term] for term in ("kd", *FEATURE_LOSSES)):
        found.append("no loss here learns from the teacher (distill.kd.weight 0, no cosine or hint loss): the student "
                     "trains on the labels alone, and the gain the report states is not distillation's")
    warmup = d.kd.params.get("warmup_epochs", 0)
    if w["kd"] and warmup > d.epochs:
        key = f"distill.kd.{d.kd.loss.params}.warmup_epochs"
        found.append(f"{d.kd.loss.label}'s weight rises over {key}={warmup:g} epochs, longer than "
                     f"distill.epochs={d.epochs}: it reaches only {d.epochs / warmup:.0%} of its weight; lower the "
                     f"warm-up (e.g. --set {key}={max(1, d.epochs // 4)})")
    return found
