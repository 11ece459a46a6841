"""What the pipeline hands a stage, and what a stage hands back.

The context binds the plain training loop (`compress.train.fit`) to the stage's run directory: the resume
checkpoint in `<stage>/last/`, the metrics sink `<stage>/metrics.json`, and the upstream files the stage
declared (`inputs(cfg)`), checked against the sha256 the manifest recorded for them.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from compress import __version__, dist
from compress.checkpoint import (
    load_training_state,
    load_weights,
    read_metadata,
    save_training_state,
    validate_resume_state,
)
from compress.config import Config
from compress.data import eval_loader, train_loader
from compress.dist import DistEnv
from compress.fileio import atomic_write_json
from compress.models import build_model
from compress.rundir import RunDir
from compress.train import FP32, Precision, ResumePoint, Schedule, fit, reduce_sums

log = logging.getLogger(__name__)


@dataclass
class StageContext:
    cfg: Config
    run: RunDir
    env: DistEnv
    stage: str
    config_hash: str
    inputs: dict  # run-relative path -> sha256 recorded by the stage that wrote it (what this stage read)
    sources: dict  # (upstream stage, output name) -> run-relative path, for each declared input present
    resume: bool  # continue from <stage>/last/ (the pipeline checked it matches this config and these inputs)
    begin: Callable = lambda: None  # call (every rank) after loading inputs, before writing anything

    def stage_path(self, *parts):
        return self.run.path(self.stage, *parts)

    def input_path(self, stage, output):
        """Absolute path of a declared input, or None when an optional input is absent."""
        rel = self.sources.get((stage, output))
        return self.run.path(rel) if rel else None

    def input_sha256(self, stage, output):
        return self.inputs.get(self.sources.get((stage, output)))

    def load_model(self, source, model_name, data):
        """Build `model_name` for the data's shape and load an upstream stage's weights (on the CPU), checking
        sha256 against the manifest and the model name against the checkpoint's metadata."""
        stage, output = source
        model = build_model(model_name, data.input_shape, data.num_classes)
        meta = load_weights(model, self.input_path(stage, output), expect_stage=stage, expect_model=model_name,
                            expect_sha256=self.input_sha256(stage, output))
        return model, meta

    def weights_metadata(self, model_name, data, parent=None):
        """Metadata stored with a stage's final weights: enough to rebuild the model and its preprocessing."""
        return {"stage": self.stage, "model": model_name, "config_hash": self.config_hash,
                "parent_sha256": parent or "", "input_shape": list(data.input_shape),
                "class_names": list(data.class_names), "mean": list(data.mean), "std": list(data.std),
                "dataset": data.name, "compress_version": __version__}

    def loaders(self, data, batch_size, key):
        """(train, val) loaders for this rank: the global batch split over the processes, DataLoader workers
        from train.num_workers, pinned memory on CUDA."""
        env, t = self.env, self.cfg.train
        per_rank = dist.per_rank_batch(batch_size, env, key)
        pin = env.device.type == "cuda"
        return (train_loader(data.train, per_rank, env.rank, env.world, self.cfg.seed, t.num_workers, pin),
                eval_loader(data.val, t.eval_batch_size, env.rank, env.world, t.num_workers, pin))

    def precision(self):
        return Precision.for_run(self.cfg.train.precision, self.env.device)

    def part_path(self, part, *parts):
        """`<stage>/...` for the stage's main model, `<stage>/<part>/...` for a second one (the baseline)."""
        return self.stage_path(*((part,) if part else ()), *parts)

    def fit(self, model, *, modules, optimizer, ocfg, loader, loss_fn, evaluate_fn, on_epoch_start=None,
            sync_modules=None, precision=FP32, part=None, extra_state=None):
        """`compress.train.fit`, resuming from and checkpointing to `<stage>[/<part>]/last/`, metrics to
        `<stage>[/<part>]/metrics.json`. `modules` (name -> unwrapped module) is what the checkpoint holds."""
        env, name = self.env, f"{self.stage} {part}" if part else self.stage
        path = self.part_path(part, "last", "checkpoint.safetensors")
        schedule = Schedule.from_config(ocfg, loader.sampler.batches_per_epoch)
        resume = self._resume_point(path, modules, optimizer, schedule) if self._resumable(path, part) else None

        def save(epoch, step, history, sums):  # every rank calls this at the same step
            if sums is not None:
                sums = reduce_sums(env, sums)
            if env.is_main:
                save_training_state(path, modules, optimizer, {
                    "stage": self.stage, "config_hash": self.config_hash, "inputs": self.inputs,
                    "epoch": epoch, "step": step, "history": history, "running": sums, "world_size": env.world,
                    "best_val_acc": max((h["val_acc"] for h in history), default=None),
                    # the learning rate is a pure function of the global step and the RNG is re-seeded from
                    # (seed, stage, epoch, step, rank) every step: (epoch, step) restores both exactly
                    "lr_schedule": {"kind": ocfg.schedule, "global_step": epoch * schedule.steps_per_epoch + step},
                    "rng": {"reseeded_from": [self.cfg.seed, self.stage, epoch, step]}, "extra": extra_state or {}})
            dist.barrier(env)

        def write_metrics(history):
            if env.is_main:
                atomic_write_json(self.part_path(part, "metrics.json"), {"stage": name, "epochs": history})

        return fit(model, loader, optimizer, loss_fn, env=env, schedule=schedule, evaluate_fn=evaluate_fn,
                   seed_key=(self.cfg.seed, self.stage, env.rank), resume=resume, save=save,
                   save_every=self.cfg.train.checkpoint_every, on_epoch_start=on_epoch_start,
                   on_epoch_end=write_metrics, sync_modules=list((sync_modules or modules).values()),
                   precision=precision, name=name, progress=self.cfg.train.progress)

    def _resumable(self, path, part):
        """The stage resumes (the pipeline checked its main checkpoint); a second part (the baseline) resumes
        only from a checkpoint of its own written with this config and these inputs, else it starts afresh."""
        if not self.resume:
            return False
        if part is None:
            return True
        if not os.path.isfile(path):
            return False
        state = read_metadata(path).get("state") or {}
        return state.get("config_hash") == self.config_hash and state.get("inputs") == self.inputs

    def _resume_point(self, path, modules, optimizer, schedule):
        state = load_training_state(path, modules, optimizer)
        validate_resume_state(state, path, schedule.epochs, schedule.steps_per_epoch)
        point = ResumePoint(state["epoch"], state["step"], state["history"],
                            state.get("running") if self.env.is_main else None)  # global sums, counted on rank 0
        if point.step and state.get("world_size") != self.env.world:
            log.warning("%s: the checkpoint was written mid-epoch by %s processes, now %d: redoing epoch %d",
                        self.stage, state.get("world_size"), self.env.world, point.epoch + 1)
            point.step, point.running = 0, None
        if self.env.is_main:
            log.info("%s: resuming from %s (epoch %d, step %d)", self.stage, self.run.rel(path), point.epoch + 1,
                     point.step)
        return point


@dataclass
class StageResult:
    metrics: dict
    outputs: list = field(default_factory=list)  # run-relative paths the stage wrote
    summary: str = ""


class Input(NamedTuple):
    """A file a stage reads from an upstream stage: the upstream stage's name and the name of the output (a
    key of that stage's OUTPUTS). An optional input that is absent or not current is simply not given."""

    stage: str
    output: str
    required: bool = True


class File(NamedTuple):
    """A file a stage reads from outside the run directory (pretrained weights), named by a config key; its
    sha256 is an input of the stage, so changing the file reruns it."""

    path: str
    key: str

    @property
    def input_key(self):
        return EXTERNAL + os.path.abspath(os.path.expanduser(self.path))


EXTERNAL = "external:"
