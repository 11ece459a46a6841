"""Logit distillation losses: pure functions of (student logits, teacher logits, target classes, parameters).

Every loss returns the batch mean of a per-sample quantity (DIST: of per-sample and per-class quantities) and is
scaled by T^2, so its gradients keep the scale of cross-entropy's whatever the temperature (Hinton et al. 2015).
They never know whether the teacher ran now or its logits came from the teacher-output store.

    hinton        T^2 KL(softmax(t/T) || softmax(s/T))                                  Hinton et al. 2015
    dkd           T^2 (alpha TCKD + beta NCKD): KL of the binary target/non-target split, plus KL of the
                  distribution among the non-target classes                            Zhao et al., CVPR 2022
    dist          tau^2 (beta (1 - mean_i pearson(p_s[i,:], p_t[i,:])) + gamma (1 - mean_c pearson(p_s[:,c],
                  p_t[:,c]))) with p = softmax(z/tau): relations within a sample and within a class
                                                                                       Huang et al., NeurIPS 2022
    standardized  T^2 KL(softmax(z(t)/T) || softmax(z(s)/T)), z(v) = (v - mean(v)) / std(v) per sample
                                                                                       Sun et al., CVPR 2024

`target` (DKD only) is each sample's class: its label where it has one, else the teacher's top class (the
caller decides; an unlabelled image has no other).

`LOGIT_LOSSES` is the registry: name -> LogitLoss (its function, label, paper settings, parameters). The config's
choices, `--help`, the reference, the log's words and the docs come from it; adding a loss is one entry here, the
regenerated config reference and its test (docs/extending.md). torch is imported inside the functions, so the
config reads this registry without loading it.
"""

from typing import Callable, NamedTuple


def hinton(student, teacher, temperature):
    """T^2 * KL(softmax(teacher/T) || softmax(student/T)), averaged over the batch."""
    import torch.nn.functional as F

    t = temperature
    return F.kl_div(F.log_softmax(student / t, dim=1), F.log_softmax(teacher / t, dim=1),
                    reduction="batchmean", log_target=True) * (t * t)


def dkd(student, teacher, target, temperature, alpha=1.0, beta=8.0):
    """Decoupled KD: T^2 * (alpha * KL(b_t || b_s) + beta * KL(q_t || q_s)), batch mean, where b = (p[target],
    1 - p[target]) is the binary split of softmax(z/T) and q = softmax over the non-target classes of z/T.
    Computed in log space (log(1 - p[target]) as a log-sum-exp over the other classes), so a confident model
    gives no log(0)."""
    import torch
    import torch.nn.functional as F

    t = temperature
    s, te = student / t, teacher / t
    gt = F.one_hot(target, s.shape[1]).bool()
    log_ps, log_pt = F.log_softmax(s, dim=1), F.log_softmax(te, dim=1)
    masked_s, masked_t = s.masked_fill(gt, float("-inf")), te.masked_fill(gt, float("-inf"))
    # log of the non-target mass: logsumexp over the other classes minus the log partition function
    bin_s = torch.stack([log_ps[gt], torch.logsumexp(masked_s, 1) - torch.logsumexp(s, 1)], dim=1)
    bin_t = torch.stack([log_pt[gt], torch.logsumexp(masked_t, 1) - torch.logsumexp(te, 1)], dim=1)
    tckd = F.kl_div(bin_s, bin_t, reduction="batchmean", log_target=True)
    q_s, q_t = F.log_softmax(masked_s, dim=1), F.log_softmax(masked_t, dim=1)
    # the target class has probability 0 in both: drop it from the sum instead of computing 0 * (-inf - -inf)
    nckd = (q_t.exp() * (q_t - q_s)).masked_fill(gt, 0.0).sum(1).mean()
    return (alpha * tckd + beta * nckd) * (t * t)


def _pearson_rows(a, b, floor=1e-3):
    """Pearson correlation of each row of a with the same row of b (the DIST paper's cosine of centred rows). Each
    centred row's norm is floored at `floor`: a row without spread (a student whose logits are all equal) then
    gives a gradient of at most about 1/floor (the paper's `+ 1e-8` under the product gave 4e6), and rows of
    probabilities with a norm above it (any real spread) get exactly the paper's correlation."""
    a = a - a.mean(1, keepdim=True)
    b = b - b.mean(1, keepdim=True)
    return (a * b).sum(1) / (_floored_norm(a, floor) * _floored_norm(b, floor))


def _floored_norm(rows, floor):
    # through the squared norm: its gradient is finite at 0, where the norm's own is not
    return rows.pow(2).sum(1).clamp_min(floor * floor).sqrt()


def dist(student, teacher, temperature, beta=1.0, gamma=1.0):
    """DIST: tau^2 * (beta * inter + gamma * intra) on p = softmax(z/tau); inter = 1 - mean over samples of the
    Pearson correlation of the student's and teacher's class probabilities, intra = 1 - mean over classes of
    the correlation across the batch. The intra term relates the samples of one batch (per process under
    DDP, as in the paper's code)."""
    import torch.nn.functional as F

    t = temperature
    p_s, p_t = F.softmax(student / t, dim=1), F.softmax(teacher / t, dim=1)
    inter = 1.0 - _pearson_rows(p_s, p_t).mean()
    intra = 1.0 - _pearson_rows(p_s.t(), p_t.t()).mean()
    return (t * t) * (beta * inter + gamma * intra)


def standardize(logits, floor=1e-4):
    """Each sample's logits minus their mean, over their (unbiased) standard deviation floored at `floor`: a sample
    whose logits are all equal gives z = 0 with a gradient of at most about 1/floor (the paper's std + 1e-7 gave
    4e6 at weight 9, 1e7 per unit), and logits with a std above it - any head past its first steps - are
    standardized exactly as in the paper."""
    return (logits - logits.mean(1, keepdim=True)) / logits.var(1, keepdim=True).clamp_min(floor * floor).sqrt()


def standardized(student, teacher, temperature):
    """Hinton KD on standardized logits (z-score per sample, student and teacher alike), T^2 * KL."""
    return hinton(standardize(student), standardize(teacher), temperature)


class LogitLoss(NamedTuple):
    """One logit loss of the registry. `fn(student, teacher, target, temperature, params)`; `paper` holds the
    temperature, its weight and the cross-entropy weight beside it in the paper's CIFAR setting (what nulls in
    the config resolve to); `params` names its own section under distill.kd ('' when it has none)."""

    fn: Callable
    label: str  # how the log and the report name it
    summary: str  # one line for --help and the config reference
    paper: dict
    params: str = ""


LOGIT_LOSSES = {
    "hinton": LogitLoss(lambda s, t, y, T, p: hinton(s, t, T), "Hinton KD",
                        "T^2 KL of the softened distributions; Hinton et al. 2015",
                        {"temperature": 4.0, "weight": 0.9, "ce_weight": 0.1}),
    "dkd": LogitLoss(lambda s, t, y, T, p: dkd(s, t, y, T, p["alpha"], p["beta"]), "DKD",
                     "decoupled target / non-target KD; Zhao et al. 2022",
                     {"temperature": 4.0, "weight": 1.0, "ce_weight": 1.0}, "dkd"),
    "dist": LogitLoss(lambda s, t, y, T, p: dist(s, t, T, p["beta"], p["gamma"]), "DIST",
                      "Pearson relations within and between classes; Huang et al. 2022",
                      # the official code's CIFAR configs weigh the DIST loss 2 beside CE 1 (and T 4)
                      {"temperature": 4.0, "weight": 2.0, "ce_weight": 1.0}, "dist"),
    "standardized": LogitLoss(lambda s, t, y, T, p: standardized(s, t, T), "standardized-logit KD",
                              "KD on z-scored logits; Sun et al. 2024",
                              {"temperature": 2.0, "weight": 9.0, "ce_weight": 0.1}),
}


def logit_loss(method, student, teacher, target, temperature, params):
    """The named method's loss; `params` holds its own parameters (dkd: alpha, beta; dist: beta, gamma)."""
    return LOGIT_LOSSES[method].fn(student, teacher, target, temperature, params)
