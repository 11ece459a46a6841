"""The training loop shared by the teacher, distill and QAT stages: `fit` -> `train_one_epoch` + `evaluate`.

Both take plain values - model, loss function, optimizer, loader, schedule - as torchvision's reference
`train_one_epoch` does, plus one `Session`: where the run happens (process group, precision), how it stays
reproducible (the seed key), where it resumes from, and how it checkpoints, stops and shows progress. They know
nothing of run directories; the stage builds the session (`compress.run.context.StageContext.session`).

Determinism and exact resume: the data order comes from the sampler's (seed, epoch), the learning rate is a
pure function of the global step, and torch's RNG (dropout) is re-seeded from (seed, stage, epoch, step, rank)
before every step. So a run resumed from any checkpoint (end of epoch, every N steps, or written on Ctrl-C)
computes exactly what the uninterrupted run would have, bit for bit.
"""

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from compress.errors import Interrupted, StageFailed
from compress.training import distributed as dist
from compress.training import interrupt
from compress.training.checkpoint import unwrap
from compress.training.distributed import DistEnv
from compress.training.precision import FP32, Precision
from compress.training.progress import Progress

log = logging.getLogger(__name__)


@dataclass
class ResumePoint:
    """Where a run continues: the epoch and step, the finished epochs' metrics, and the epoch's running sums so
    far (global; rank 0 carries them)."""

    epoch: int = 0
    step: int = 0
    history: list = field(default_factory=list)
    running: Optional[dict] = None


@dataclass
class Session:
    """Everything around the loop, in one object: the process group and precision, the seed key (seed, stage),
    the point to resume from, `save(epoch, step, history, sums)` for the resume checkpoint (at every epoch end,
    every `save_every` steps, and on a stop request), `log_epoch(history)` for the metrics file, and whether
    to draw a progress bar."""

    env: DistEnv = field(default_factory=DistEnv)
    name: str = "train"
    precision: Precision = FP32
    seed_key: tuple = (0, "train")
    resume: ResumePoint = field(default_factory=ResumePoint)
    save: Optional[Callable] = None
    save_every: int = 0
    log_epoch: Optional[Callable] = None
    progress: bool = False
    clip_grad_norm: Optional[float] = None  # train.clip_grad_norm: the gradients' global L2 norm is kept under it
    history: list = field(default_factory=list)  # the finished epochs' metrics (`fit` keeps it)

    def checkpoint(self, epoch, step, sums=None):
        if self.save:
            self.save(epoch, step, self.history, sums)

    def seed_step(self, epoch, step):
        seed, stage = self.seed_key
        digest = hashlib.blake2b(f"{seed}/{stage}/{epoch}/{step}/{self.env.rank}".encode(), digest_size=8).digest()
        torch.manual_seed(int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF)

    def stop(self, message):
        """Raise Interrupted (every rank together) with the resume advice."""
        dist.raise_on_main(self.env, Interrupted(f"{message}; rerun the same command to resume"))


def fit(model, loss_fn, optimizer, loader, schedule, evaluate_fn, session, on_epoch_start=None):
    """Train `model` (maybe DDP-wrapped) for `schedule.epochs` from `session.resume`; returns the per-epoch
    metrics. `loss_fn(batch, step) -> (loss, {term: float})` (step: the global step); `evaluate_fn(epoch) ->
    metrics`; `on_epoch_start(epoch)` (e.g. QAT's freeze schedule) runs before each epoch, resumed ones too."""
    session.history = history = list(session.resume.history)
    for epoch in range(session.resume.epoch, schedule.epochs):
        if interrupt.requested(session.env):
            session.stop(f"interrupted at the start of epoch {epoch + 1} of {session.name}")
        if on_epoch_start:
            on_epoch_start(epoch)
        loader.sampler.set_epoch(epoch, session.resume.step if epoch == session.resume.epoch else 0)
        carried = _carried_images(session, epoch)
        began = time.perf_counter()
        sums = train_one_epoch(model, loss_fn, optimizer, loader, schedule, epoch, session)
        seconds = time.perf_counter() - began
        trained = sums["images"] - carried  # this run's images: the speed is theirs over this run's seconds
        dist.sync_buffers(session.env, unwrap(model))  # rank 0's BN statistics / observer ranges are saved
        metrics = {"epoch": epoch + 1, **epoch_losses(sums), **evaluate_fn(epoch),
                   "images_per_s": round(trained / seconds, 1) if seconds > 0 and trained > 0 else None,
                   "seconds": round(seconds, 2), "lr_end": optimizer.param_groups[0]["lr"]}
        history.append(metrics)
        if session.env.is_main:
            log.info("%s: epoch %d/%d %s", session.name, epoch + 1, schedule.epochs,
                     _epoch_words(metrics, carried and session.resume.step, schedule.steps_per_epoch))
        session.checkpoint(epoch + 1, 0)
        if session.log_epoch:
            session.log_epoch(history)
    return list(history)


def _epoch_words(metrics, resumed_at, steps):
    """The epoch's log line; an epoch resumed into says where, and one whose steps all ran before the
    interruption (this run only evaluated it) shows no time or speed of its own."""
    if not resumed_at:
        return format_metrics(metrics)
    if resumed_at >= steps:
        return (format_metrics({k: v for k, v in metrics.items() if k not in ("seconds", "images_per_s")})
                + f" (its {steps} steps ran before the interruption)")
    words, where = format_metrics(metrics), f"resumed at step {resumed_at + 1} of {steps}"
    return words[:-1] + f", {where})" if words.endswith(")") else f"{words} ({where})"


def _carried_images(session, epoch):
    """The images of `epoch` trained before the resume point (0 unless resuming into it mid-epoch). Rank 0 alone
    holds the epoch's running sums, so every rank asks it - the same collective on each, since the resume point
    is the same on each."""
    resume = session.resume
    if epoch != resume.epoch or not resume.step:
        return 0.0
    mine = float((resume.running or {}).get("images", 0.0))
    return float(dist.all_reduce(session.env, torch.tensor([mine], dtype=torch.float64)).item())


def train_one_epoch(model, loss_fn, optimizer, loader, schedule, epoch, session):
    """One pass over `loader` - this rank's batches of `epoch`, from the resume step when resuming into it (the
    caller has set the sampler's epoch) - returns the epoch's all-reduced sums (images, loss, each loss term)."""
    env, steps = session.env, schedule.steps_per_epoch
    start = session.resume if epoch == session.resume.epoch else ResumePoint(epoch)
    model.train()
    sums = dict(start.running or {"images": 0.0, "loss": 0.0})
    label = f"{session.name} {epoch + 1}/{schedule.epochs}"
    bar = Progress(steps, label, session.progress and env.is_main, done=start.step)
    for step, batch in enumerate(loader, start=start.step):
        session.seed_step(epoch, step)
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(epoch * steps + step)
        batch = _to_device(batch, session.precision, env.device)
        with session.precision.autocast():
            loss, parts = _forward(loss_fn, batch, epoch * steps + step, model, session, schedule, epoch, step, bar)
        value = loss.item()
        stop = _agree_on_step(session, schedule, bar, epoch, step, value, batch.x)
        optimizer.zero_grad(set_to_none=True)
        session.precision.step(loss, optimizer, session.clip_grad_norm)
        n = len(batch.y)
        sums["images"] += n
        sums["loss"] += value * n
        for term, part in parts.items():
            sums[term] = sums.get(term, 0.0) + float(part) * n
        bar.update(loss=value)
        if stop:  # Ctrl-C / SIGTERM on any rank: this step is done; checkpoint and leave together
            bar.close()
            session.checkpoint(epoch, step + 1, sums)
            done = f"after {'the last' if step + 1 == steps else step + 1} of its {steps} steps"
            session.stop(f"interrupted at epoch {epoch + 1} of {session.name} ({done})")
        if session.save_every and (step + 1) % session.save_every == 0 and step + 1 < steps:
            session.checkpoint(epoch, step + 1, sums)
    bar.close()
    return reduce_sums(env, sums)


def _to_device(batch, precision, device):
    x = precision.inputs(batch.x, device)
    return batch._replace(x=x, **{k: getattr(batch, k).to(device, non_blocking=True)
                                  for k in batch._fields if k != "x"})


def _forward(loss_fn, batch, global_step, model, session, schedule, epoch, step, bar):
    try:
        return loss_fn(batch, global_step)
    except RuntimeError:
        # The previous update left a weight non-finite and the forward failed on it before the loss could
        # (a fake-quant observer cannot place a zero point in a NaN range). Replicas hold the same weights,
        # so every rank fails here together.
        if all(torch.isfinite(p).all() for p in model.parameters()):
            raise
        bar.close()
        dist.raise_on_main(session.env, StageFailed(_diverged(session.name, "the weights became non-finite", schedule,
                                                              epoch, step)))


def _agree_on_step(session, schedule, bar, epoch, step, value, inputs):
    """One collective per step, before the update, so every rank acts at the same step: a non-finite loss on
    any rank fails the stage (nothing of this step is applied); returns whether any rank was asked to stop
    (Ctrl-C / SIGTERM), which the caller honours once this step's update is done."""
    bad_loss = not math.isfinite(value)
    degenerate = bad_loss and _degenerate_inputs(inputs)  # asked only when it matters: it reads the whole batch
    local = torch.tensor([int(bad_loss), int(degenerate), 1 if interrupt.local_request() else 0])
    bad, inputs_bad, stop = (bool(v) for v in dist.all_reduce(session.env, local, op="max").tolist())
    if bad:
        bar.close()
        dist.raise_on_main(session.env, StageFailed(_diverged(session.name, f"the loss became {value}", schedule, epoch,
                                                              step, inputs_bad)))
    return stop


HUGE_INPUT = 1e4  # normalised pixels are a few units; this many means a std of almost nothing


def _degenerate_inputs(x):
    """Whether a batch's normalised images are non-finite or huge: a degenerate normalisation (data.std tiny, or
    images without spread), which no learning rate mends."""
    x = x.float()
    return not bool(torch.isfinite(x).all()) or float(x.abs().max()) > HUGE_INPUT


def _diverged(name, what, schedule, epoch, step, inputs_bad=False):
    stage = name.split()[0]
    where = f"{name}: {what} at epoch {epoch + 1}, step {step + 1}; the last resume checkpoint is kept"
    if inputs_bad:
        return (f"{where} - the images the model saw were already non-finite or huge after normalisation: data.std "
                "is near 0 (given too small, or computed on images without spread, such as blank ones); set data.mean "
                "and data.std to the images' own values (or leave both null), check the images, and rerun")
    return (f"{where} - lower {stage}.lr (e.g. --set {stage}.lr={schedule.lr / 10:g}, a tenth) and rerun, or --force "
            "to start over")


def reduce_sums(env, sums):
    keys = sorted(sums)
    total = dist.all_reduce(env, torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    return dict(zip(keys, total.tolist()))


@torch.no_grad()
def evaluate(model, loader, env, precision=FP32):
    """Loss and accuracy over the whole validation set: counts are all-reduced, not per-rank averages."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for batch in loader:
        x, y = precision.inputs(batch.x, env.device), batch.y.to(env.device, non_blocking=True)
        with precision.autocast():
            logits = model(x).float()
        sums += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                              (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    loss, correct, count = dist.all_reduce(env, sums).tolist()
    return {"val_loss": loss / max(count, 1), "val_acc": 100.0 * correct / max(count, 1), "val_count": int(count)}


def epoch_losses(sums):
    n = max(sums["images"], 1.0)
    out = {"train_loss": sums["loss"] / n}
    out.update({f"train_{k}": v / n for k, v in sums.items() if k not in ("images", "loss")})
    return out


def format_metrics(m):
    shown = []
    for key in ("train_loss", "val_acc", "int8_acc", "images_per_s", "seconds"):
        if m.get(key) is None:
            continue
        value = m[key]
        if key.endswith("acc"):
            shown.append(f"{key} {value:.2f}%")
        elif key == "seconds":
            shown.append(f"({value:.1f}s)")
        elif key == "images_per_s":
            shown.append(f"{value:.0f} img/s")
        else:
            shown.append(f"{key} {value:.4f}")
    return " ".join(shown)
