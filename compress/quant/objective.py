"""What the qat stage minimises: cross-entropy on the labels plus Hinton KD from a frozen copy of the float model
it starts from, each weighted by the qat config (`qat.ce_weight`, `qat.kd_weight`)."""

import copy

import torch

from compress.distill.logit_losses import hinton
from compress.training.losses import label_loss


def qat_loss(q, model, reference):
    """loss(batch, step) -> (total, {term: value}): qat.ce_weight x cross-entropy on the labels plus
    qat.kd_weight x Hinton KD from `reference`, the frozen float model (None when qat.kd_weight is 0)."""

    def loss_fn(batch, step):
        logits = model(batch.x)
        terms = {}
        if q.ce_weight:
            terms["ce"] = (q.ce_weight, label_loss(logits, batch, q.label_smoothing))
        if q.kd_weight:
            with torch.no_grad():
                target = reference(batch.x)
            terms["kd"] = (q.kd_weight, hinton(logits, target, q.kd_temperature))
        total = sum(w * value for w, value in terms.values())
        return total, {k: value.item() for k, (_, value) in terms.items()}

    return loss_fn


def frozen_copy(model):
    """An eval-mode copy of the float model, with no gradients: the target QAT's distillation term keeps the
    fake-quant model close to (prepare edits the original's modules in place)."""
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference
