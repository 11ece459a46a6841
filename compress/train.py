"""The training loop shared by the teacher, distill and QAT stages: `fit` -> `train_one_epoch` + `evaluate`.

Determinism and exact resume: the data order comes from DistributedSampler(seed).set_epoch(epoch), the
learning rate is a pure function of the global step, and torch's RNG (dropout) is re-seeded from
(seed, stage, epoch, step, rank) before every step. So a run resumed from any checkpoint (end of epoch, every
N steps, or written on Ctrl-C) computes exactly what the uninterrupted run would have, bit for bit.
"""

import hashlib
import logging
import math
import os
import signal
import time

import torch
import torch.nn.functional as F

from compress import dist, interrupt
from compress.checkpoint import (
    atomic_write_json,
    load_training_state,
    save_training_state,
)
from compress.data import set_epoch
from compress.errors import Interrupted, StageFailed
from compress.progress import Progress

log = logging.getLogger(__name__)


def build_optimizer(params, ocfg):
    params = [p for p in params if p.requires_grad]
    if ocfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=ocfg.lr, momentum=ocfg.momentum, weight_decay=ocfg.weight_decay)
    if ocfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=ocfg.lr, weight_decay=ocfg.weight_decay)
    return torch.optim.Adam(params, lr=ocfg.lr, weight_decay=ocfg.weight_decay)


def learning_rate(ocfg, step, steps_per_epoch):
    """Per-step learning rate: cosine from lr to 0 over the run, step decay per `step_size` epochs, or flat."""
    if ocfg.schedule == "cosine":
        total = ocfg.epochs * steps_per_epoch
        return ocfg.lr * 0.5 * (1.0 + math.cos(math.pi * step / total))
    if ocfg.schedule == "step":
        return ocfg.lr * ocfg.gamma ** ((step // steps_per_epoch) // ocfg.step_size)
    return ocfg.lr


def seed_step(seed, stage, epoch, step, rank):
    digest = hashlib.blake2b(f"{seed}/{stage}/{epoch}/{step}/{rank}".encode(), digest_size=8).digest()
    torch.manual_seed(int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF)


def _fault(stage, epoch, step, kind):
    """Testing hook: COMPRESS_FAULT=stage:epoch:step[:kill|nan[:rank]] SIGKILLs this process after that step's
    update (a real kill -9 at a reproducible moment) or makes that step's loss NaN; only on `rank` if given,
    and only in the first attempt of a torchrun group (a restarted group runs clean). Used by the tests."""
    parts = os.environ.get("COMPRESS_FAULT", "").split(":")
    if parts[:3] != [stage, str(epoch), str(step)] or (parts[3] if len(parts) > 3 else "kill") != kind:
        return False
    if len(parts) > 4 and parts[4] != os.environ.get("RANK", "0"):
        return False
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


@torch.no_grad()
def evaluate(model, loader, env):
    """Loss and accuracy over the whole validation set: counts are all-reduced, not per-rank averages."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for x, y, _ in loader:
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        logits = model(x)
        sums += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                              (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    loss, correct, count = dist.all_reduce(env, sums).tolist()
    return {"val_loss": loss / max(count, 1), "val_acc": 100.0 * correct / max(count, 1), "val_count": int(count)}


def train_one_epoch(ctx, model, loader, optimizer, loss_fn, ocfg, epoch, start_step, sums, save):
    """One pass over this rank's shard from `start_step`; returns the epoch's all-reduced sums."""
    env, steps_per_epoch = ctx.env, len(loader.sampler.base)
    model.train()
    sums = dict(sums or {"images": 0.0, "loss": 0.0})
    bar = Progress(len(loader), f"{ctx.stage} {epoch + 1}/{ocfg.epochs}", ctx.cfg.train.progress and env.is_main)
    for step, (x, y, idx) in enumerate(loader, start=start_step):
        seed_step(ctx.cfg.seed, ctx.stage, epoch, step, env.rank)
        lr = learning_rate(ocfg, epoch * steps_per_epoch + step, steps_per_epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        loss, parts = loss_fn(x, y, idx)
        value = float("nan") if _fault(ctx.stage, epoch, step, "nan") else loss.item()
        stop = _check_step(ctx, bar, epoch, step, value)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        n = len(y)
        sums["images"] += n
        sums["loss"] += value * n
        for name, part in parts.items():
            sums[name] = sums.get(name, 0.0) + float(part) * n
        bar.update(loss=value)
        if stop:  # Ctrl-C / SIGTERM on any rank: this step is done; checkpoint and leave together
            save(epoch, step + 1, sums)
            bar.close()
            dist.raise_on_main(env, Interrupted(f"interrupted at epoch {epoch + 1} of {ctx.stage} (after "
                                                f"{step + 1} steps); rerun the same command to resume"))
        every = ctx.cfg.train.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < steps_per_epoch:
            save(epoch, step + 1, sums)
        if _fault(ctx.stage, epoch, step, "kill"):
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    return reduce_sums(env, sums)


def _check_step(ctx, bar, epoch, step, value):
    """One collective per step, before the update, so every rank acts at the same step: a non-finite loss on
    any rank fails the stage (nothing of this step is applied); returns whether any rank was asked to stop
    (Ctrl-C / SIGTERM), which the caller honours once this step's update is done."""
    env = ctx.env
    bad, stop = _agree(env, not math.isfinite(value), interrupt.local_request())
    if bad:
        bar.close()
        dist.raise_on_main(env, StageFailed(
            f"{ctx.stage}: the loss became {value} at epoch {epoch + 1}, step {step + 1}; the last resume "
            f"checkpoint ({ctx.run.rel(ctx.stage_path('last'))}/) is kept - lower {ctx.stage}.lr and rerun "
            "(or --force to start over)"))
    return stop


def _agree(env, *flags):
    """Each flag OR-ed over all ranks."""
    local = torch.tensor([1 if f else 0 for f in flags], dtype=torch.long)
    return [bool(v) for v in dist.all_reduce(env, local, op="max").tolist()]


def reduce_sums(env, sums):
    keys = sorted(sums)
    total = dist.all_reduce(env, torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    return dict(zip(keys, total.tolist()))


def fit(ctx, *, model, modules, optimizer, ocfg, loader, loss_fn, evaluate_fn, on_epoch_start=None):
    """Train `model` (maybe DDP-wrapped) for `ocfg.epochs`, resuming from the stage's `last/` checkpoint if
    the pipeline said so. `modules` (name -> unwrapped module) is what the resume checkpoint holds.
    Returns the per-epoch metric history (also written to <stage>/metrics.json)."""
    env, path = ctx.env, ctx.run.resume_checkpoint(ctx.stage)
    epoch0, step0, history, running = 0, 0, [], None
    if ctx.resume:
        state = load_training_state(path, modules, optimizer)
        epoch0, step0, history = state["epoch"], state["step"], state["history"]
        running = state.get("running") if env.is_main else None  # global sums; counted once, on rank 0
        if step0 and state.get("world_size") != env.world:
            log.warning("%s: the checkpoint was written mid-epoch by %s processes, now %d: redoing epoch %d",
                        ctx.stage, state.get("world_size"), env.world, epoch0 + 1)
            step0, running = 0, None
        log.info("%s: resuming from %s (epoch %d, step %d)", ctx.stage, ctx.run.rel(path), epoch0 + 1, step0)

    def save(epoch, step, sums):
        # every rank calls this at the same step; rank 0 stores the global running sums
        if sums is not None:
            sums = reduce_sums(env, sums)
        if env.is_main:
            save_training_state(path, modules, optimizer, {
                "stage": ctx.stage, "config_hash": ctx.config_hash, "inputs": ctx.inputs,
                "epoch": epoch, "step": step, "history": history, "running": sums, "world_size": env.world,
                "best_val_acc": max((h["val_acc"] for h in history), default=None),
                # the learning rate is a pure function of the global step and the RNG is re-seeded from
                # (seed, stage, epoch, step, rank) every step: (epoch, step) restores both exactly
                "lr_schedule": {"kind": ocfg.schedule, "global_step": epoch * len(loader.sampler.base) + step},
                "rng": {"reseeded_from": [ctx.cfg.seed, ctx.stage, epoch, step]}})
        dist.barrier(env)

    for epoch in range(epoch0, ocfg.epochs):
        if interrupt.requested(env):
            dist.raise_on_main(env, Interrupted(f"interrupted at epoch {epoch + 1} of {ctx.stage} (before its first "
                                                "step); rerun the same command to resume"))
        if on_epoch_start:
            on_epoch_start(epoch)
        skip = step0 if epoch == epoch0 else 0
        set_epoch(loader, epoch, skip)
        start = time.perf_counter()
        sums = train_one_epoch(ctx, model, loader, optimizer, loss_fn, ocfg, epoch, skip,
                               running if epoch == epoch0 else None, save)
        seconds = time.perf_counter() - start
        for module in modules.values():
            dist.sync_buffers(env, module)
        metrics = {"epoch": epoch + 1, **epoch_losses(sums), **evaluate_fn(epoch),
                   "images_per_s": round(sums["images"] / seconds, 1) if seconds > 0 else None,
                   "seconds": round(seconds, 2), "lr_end": optimizer.param_groups[0]["lr"]}
        history.append(metrics)
        log.info("%s: epoch %d/%d %s", ctx.stage, epoch + 1, ocfg.epochs, format_metrics(metrics))
        save(epoch + 1, 0, None)
        if env.is_main:
            atomic_write_json(ctx.stage_path("metrics.json"), {"stage": ctx.stage, "epochs": history})
    return history


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
