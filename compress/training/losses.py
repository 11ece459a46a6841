"""The loss on labels every training stage uses: cross-entropy that understands mixed and unlabelled images."""

import torch
import torch.nn.functional as F


def label_loss(logits, batch, label_smoothing=0.0):
    """Cross-entropy on the labels a batch has: a mixed image (mixup/cutmix) weighs its own label by its share
    `batch.own` and its partner's by the rest; an unlabelled image (label -1) counts for nothing. Averaged over
    the labelled weight of the batch (0 for a batch without any label)."""
    own = batch.own.to(logits.dtype)
    w_own = own * (batch.y >= 0)
    loss = w_own * F.cross_entropy(logits, batch.y.clamp_min(0), reduction="none", label_smoothing=label_smoothing)
    w_partner = (1 - own) * (batch.partner_y >= 0)  # all zero without mixing (own = 1)
    loss = loss + w_partner * F.cross_entropy(logits, batch.partner_y.clamp_min(0), reduction="none",
                                              label_smoothing=label_smoothing)
    return loss.sum() / (w_own + w_partner).sum().clamp_min(torch.finfo(logits.dtype).tiny)
