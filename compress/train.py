"""The training loop shared by the teacher, distill and QAT stages: `fit` -> `train_one_epoch` + `evaluate`.

Both take plain values (model, loader, optimizer, loss function, schedule, callbacks), as torchvision's
reference `train_one_epoch` does; they know nothing of run directories. The stage binds them to its files
(`StageContext.fit`): where the resume checkpoint goes, where metrics are written.

Determinism and exact resume: the data order comes from the sampler's (seed, epoch), the learning rate is a
pure function of the global step, and torch's RNG (dropout) is re-seeded from (seed, stage, epoch, step, rank)
before every step. So a run resumed from any checkpoint (end of epoch, every N steps, or written on Ctrl-C)
computes exactly what the uninterrupted run would have, bit for bit.
"""

import contextlib
import hashlib
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compress import dist, interrupt
from compress.data import Batch
from compress.errors import Interrupted, StageFailed
from compress.progress import Progress

log = logging.getLogger(__name__)


def build_optimizer(params, ocfg):
    params = [p for p in params if p.requires_grad]
    if ocfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=ocfg.lr, momentum=ocfg.momentum, weight_decay=ocfg.weight_decay,
                               nesterov=ocfg.nesterov and ocfg.momentum > 0)
    if ocfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=ocfg.lr, weight_decay=ocfg.weight_decay)
    return torch.optim.Adam(params, lr=ocfg.lr, weight_decay=ocfg.weight_decay)


@dataclass(frozen=True)
class Schedule:
    """The learning rate as a pure function of the global step: linear warm-up, then cosine to 0, step decay
    every `step_size` epochs, or flat."""

    kind: str
    lr: float
    epochs: int
    steps_per_epoch: int
    warmup_epochs: float = 0.0
    step_size: int = 1
    gamma: float = 0.1

    @classmethod
    def from_config(cls, ocfg, steps_per_epoch):
        return cls(ocfg.schedule, ocfg.lr, ocfg.epochs, steps_per_epoch, ocfg.warmup_epochs, ocfg.step_size,
                   ocfg.gamma)

    def lr_at(self, step):
        warmup = round(self.warmup_epochs * self.steps_per_epoch)
        if step < warmup:
            return self.lr * (step + 1) / warmup
        if self.kind == "cosine":
            total = max(self.epochs * self.steps_per_epoch - warmup, 1)
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / total))
        if self.kind == "step":
            return self.lr * self.gamma ** ((step // self.steps_per_epoch) // self.step_size)
        return self.lr


def seed_step(seed, stage, epoch, step, rank):
    digest = hashlib.blake2b(f"{seed}/{stage}/{epoch}/{step}/{rank}".encode(), digest_size=8).digest()
    torch.manual_seed(int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF)


class Precision:
    """fp32, or autocast (bf16, or fp16 with a gradient scaler), in a memory format: channels-last for the
    teacher and distill stages (`for_run`), the default layout for QAT and anything else (`FP32`). A plain
    value the loop is given; `for_run` picks it from train.precision."""

    def __init__(self, dtype=None, device_type="cpu", memory_format=torch.contiguous_format):
        self.dtype, self.device_type, self.memory_format = dtype, device_type, memory_format
        self.scaler = torch.amp.GradScaler(device_type) if dtype == torch.float16 else None

    @classmethod
    def for_run(cls, choice, device):
        """auto: bf16 on CUDA (fp16 + gradient scaling where bf16 is missing), fp32 on the CPU. Channels-last
        either way: convolutions train 1.15-2x faster in it on the CPU (BENCHMARKS.md), and tensor cores want
        it on CUDA."""
        if choice == "auto":
            if device.type != "cuda":
                return cls(None, device.type, torch.channels_last)
            choice = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        if choice == "fp16" and device.type != "cuda":
            from compress.errors import InputError

            raise InputError("train.precision=fp16 needs a CUDA device; use auto, fp32 or bf16 on the CPU")
        return cls({"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[choice], device.type,
                   torch.channels_last)

    @property
    def name(self):
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    @property
    def layout(self):
        return "channels_last" if self.memory_format == torch.channels_last else "contiguous"

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def place(self, models, example):
        """Put the models (in place) into this precision's memory format, and return the precision to train
        them with. A forward that cannot take channels-last tensors (a model of the user's that calls
        `x.view(n, -1)` on a feature map) is found here, on one example batch in eval mode, before anything is
        written: then every model stays in the default layout, which computes the same function."""
        if self.memory_format == torch.contiguous_format:
            return self
        for model in models:
            model.to(memory_format=self.memory_format)
        device = next((p.device for m in models for p in m.parameters()), torch.device("cpu"))
        modes = [m.training for m in models]
        try:
            with torch.no_grad(), self.autocast():
                for model in models:
                    model.eval()(self.inputs(example, device))
        except RuntimeError as e:
            log.info("%s does not run on channels-last tensors (%s); training in the default memory layout",
                     type(model).__name__, str(e).splitlines()[0] if str(e) else "RuntimeError")
            for m in models:
                m.to(memory_format=torch.contiguous_format)
            return Precision(self.dtype, self.device_type)
        finally:
            for m, mode in zip(models, modes):
                m.train(mode)
        return self

    def inputs(self, x, device):
        return x.to(device, non_blocking=True, memory_format=self.memory_format) if x.dim() == 4 else x.to(device)

    def step(self, loss, optimizer):
        if self.scaler is None:
            loss.backward()
            optimizer.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)
        self.scaler.update()


FP32 = Precision()


@torch.no_grad()
def evaluate(model, loader, env, precision=FP32):
    """Loss and accuracy over the whole validation set: counts are all-reduced, not per-rank averages."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for x, y, *_ in loader:
        x, y = precision.inputs(x, env.device), y.to(env.device, non_blocking=True)
        with precision.autocast():
            logits = model(x).float()
        sums += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                              (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    loss, correct, count = dist.all_reduce(env, sums).tolist()
    return {"val_loss": loss / max(count, 1), "val_acc": 100.0 * correct / max(count, 1), "val_count": int(count)}


def train_one_epoch(model, loader, optimizer, loss_fn, *, env, epoch, schedule, seed_key, start_step=0, sums=None,
                    save=None, save_every=0, precision=FP32, name="train", progress=False):
    """One pass over this rank's batches of `epoch` from `start_step`; returns the epoch's all-reduced sums.

    `loss_fn(batch) -> (loss, {term: float})`; `seed_key` = (seed, stage, rank) re-seeds torch before each
    step; `save(epoch, step, sums)` writes the resume checkpoint (every `save_every` steps, and when a
    Ctrl-C/SIGTERM arrives: then the step finishes, `save` runs and Interrupted is raised)."""
    steps_per_epoch = schedule.steps_per_epoch
    model.train()
    sums = dict(sums or {"images": 0.0, "loss": 0.0})
    bar = Progress(steps_per_epoch - start_step, f"{name} {epoch + 1}/{schedule.epochs}", progress and env.is_main)
    for step, batch in enumerate(loader, start=start_step):
        seed_step(*seed_key[:2], epoch, step, seed_key[2])
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(epoch * steps_per_epoch + step)
        batch = Batch(precision.inputs(batch.x, env.device), batch.y.to(env.device, non_blocking=True), *batch[2:])
        try:
            with precision.autocast():
                loss, parts = loss_fn(batch)
        except RuntimeError:
            # The previous update left a weight non-finite and the forward failed on it before the loss could
            # (a fake-quant observer cannot place a zero point in a NaN range). Replicas hold the same
            # weights, so every rank fails here together.
            if all(torch.isfinite(p).all() for p in model.parameters()):
                raise
            bar.close()
            dist.raise_on_main(env, StageFailed(_diverged(name, "the weights became non-finite", epoch, step)))
        value = loss.item()
        stop = _agree_on_step(env, bar, name, epoch, step, value)
        optimizer.zero_grad(set_to_none=True)
        precision.step(loss, optimizer)
        n = len(batch.y)
        sums["images"] += n
        sums["loss"] += value * n
        for term, part in parts.items():
            sums[term] = sums.get(term, 0.0) + float(part) * n
        bar.update(loss=value)
        if stop:  # Ctrl-C / SIGTERM on any rank: this step is done; checkpoint and leave together
            bar.close()
            if save:
                save(epoch, step + 1, sums)
            dist.raise_on_main(env, Interrupted(f"interrupted at epoch {epoch + 1} of {name} (after {step + 1} "
                                                "steps); rerun the same command to resume"))
        if save and save_every and (step + 1) % save_every == 0 and step + 1 < steps_per_epoch:
            save(epoch, step + 1, sums)
    bar.close()
    return reduce_sums(env, sums)


def _agree_on_step(env, bar, name, epoch, step, value):
    """One collective per step, before the update, so every rank acts at the same step: a non-finite loss on
    any rank fails the stage (nothing of this step is applied); returns whether any rank was asked to stop
    (Ctrl-C / SIGTERM), which the caller honours once this step's update is done."""
    local = torch.tensor([0 if math.isfinite(value) else 1, 1 if interrupt.local_request() else 0])
    bad, stop = (bool(v) for v in dist.all_reduce(env, local, op="max").tolist())
    if bad:
        bar.close()
        dist.raise_on_main(env, StageFailed(_diverged(name, f"the loss became {value}", epoch, step)))
    return stop


def _diverged(name, what, epoch, step):
    return (f"{name}: {what} at epoch {epoch + 1}, step {step + 1}; the last resume checkpoint is kept - lower "
            f"{name}.lr and rerun (or --force to start over)")


def reduce_sums(env, sums):
    keys = sorted(sums)
    total = dist.all_reduce(env, torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    return dict(zip(keys, total.tolist()))


@dataclass
class ResumePoint:
    """Where an interrupted run stopped: the epoch and step to continue from, the finished epochs' metrics,
    and the epoch's running sums so far (global; rank 0 carries them)."""

    epoch: int = 0
    step: int = 0
    history: list = None
    running: dict = None


def fit(model, loader, optimizer, loss_fn, *, env, schedule, evaluate_fn, seed_key, resume=None, save=None,
        save_every=0, on_epoch_start=None, on_epoch_end=None, sync_modules=(), precision=FP32, name="train",
        progress=False):
    """Train `model` (maybe DDP-wrapped) for `schedule.epochs` from `resume` (a ResumePoint, or the start).

    `loader.sampler` is an `EpochBatches`; `evaluate_fn(epoch) -> metrics`; `save(epoch, step, history, sums)`
    writes the resume checkpoint (called at the end of every epoch too); `on_epoch_end(history)` is the
    metrics sink; `sync_modules` get rank 0's buffers after each epoch. Returns the per-epoch metric history."""
    start = resume or ResumePoint()
    history = list(start.history or [])
    saver = (lambda epoch, step, sums: save(epoch, step, history, sums)) if save else None
    for epoch in range(start.epoch, schedule.epochs):
        if interrupt.requested(env):
            dist.raise_on_main(env, Interrupted(f"interrupted at epoch {epoch + 1} of {name} (before its first "
                                                "step); rerun the same command to resume"))
        if on_epoch_start:
            on_epoch_start(epoch)
        skip = start.step if epoch == start.epoch else 0
        loader.sampler.set_epoch(epoch, skip)
        began = time.perf_counter()
        sums = train_one_epoch(model, loader, optimizer, loss_fn, env=env, epoch=epoch, schedule=schedule,
                               seed_key=seed_key, start_step=skip, sums=start.running if epoch == start.epoch else None,
                               save=saver, save_every=save_every, precision=precision, name=name, progress=progress)
        seconds = time.perf_counter() - began
        for module in sync_modules:
            dist.sync_buffers(env, module)
        metrics = {"epoch": epoch + 1, **epoch_losses(sums), **evaluate_fn(epoch),
                   "images_per_s": round(sums["images"] / seconds, 1) if seconds > 0 else None,
                   "seconds": round(seconds, 2), "lr_end": optimizer.param_groups[0]["lr"]}
        history.append(metrics)
        if env.is_main:
            log.info("%s: epoch %d/%d %s", name, epoch + 1, schedule.epochs, format_metrics(metrics))
        if saver:
            saver(epoch + 1, 0, None)
        if on_epoch_end:
            on_epoch_end(history)
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
