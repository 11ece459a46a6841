"""What the pipeline hands a stage: its view of the config, the run directory, the process group, and its
StageState (what to do and why: fresh, or resume part P from checkpoint X at epoch E, step S).

The context binds the plain training loop to the stage's files: `session(...)` gives the loop's Session for one
part of the stage - restored from the resume checkpoint the state names, checkpointing to `<stage>[/<part>]/last/`
and writing metrics to `<stage>[/<part>]/metrics.json` - and `load_model` reads an upstream stage's weights,
checked against the sha256 the manifest recorded for them.
"""

import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from compress import __version__
from compress.cpus import loader_workers
from compress.data.datasets import load_data
from compress.data.pixels import Place
from compress.data.sampling import eval_loader, train_loader
from compress.errors import CompressError, InputError
from compress.fileio import atomic_write_json
from compress.models.registry import build_model
from compress.run.config import ConfigView
from compress.run.rundir import RunDir
from compress.run.state import StageState, checkpoint_rel
from compress.training import distributed as dist
from compress.training.checkpoint import (
    load_into,
    load_training_state,
    read_metadata,
    read_weights,
    save_training_state,
    validate_resume_state,
)
from compress.training.distributed import DistEnv
from compress.training.loop import ResumePoint, Session, reduce_sums
from compress.training.precision import FP32, Precision

log = logging.getLogger(__name__)


def pixel_place(run, data_cfg, env):
    """Where the images are decoded once (data.cache_dir, else cache/pixels/ in the run directory), by the
    processes of `env`."""
    folder = os.path.abspath(os.path.expanduser(data_cfg.cache_dir)) if data_cfg.cache_dir else run.pixel_cache
    return Place(folder, env, in_run_dir=not data_cfg.cache_dir, shown_from="" if data_cfg.cache_dir else run.root)


@dataclass
class StageContext:
    cfg: ConfigView  # the stage's CONFIG_KEYS and `train`, nothing else
    run: RunDir
    env: DistEnv
    state: StageState
    begin: Callable = lambda: None  # call (every rank) after loading inputs, before writing anything
    rank0_only: bool = False  # the stage runs on rank 0 alone (export): no collective may be used
    # per part ('' the main model): the process counts that trained it so far, in order, read back from its resume
    # checkpoint - a stage resumed with another count records them all (`world_sizes`)
    trained_by: dict = field(default_factory=dict)

    @property
    def stage(self):
        return self.state.stage

    def stage_path(self, *parts):
        return self.run.path(self.stage, *parts)

    def part_path(self, part, *parts):
        """`<stage>/...` for the stage's main model, `<stage>/<part>/...` for another one (the baseline)."""
        return self.stage_path(*((part,) if part else ()), *parts)

    def input_path(self, stage, output):
        """Absolute path of a declared input, or None when an optional input is absent."""
        rel = self.state.sources.get(f"{stage}:{output}")
        return self.run.path(rel) if rel else None

    def input_sha256(self, stage, output):
        return self.state.inputs.get(self.state.sources.get(f"{stage}:{output}"))

    def load_data(self, unlabeled=False):
        """The stage's data (`compress.data.datasets.load_data`), image files decoded once into the pixel cache
        (data.cache_dir, else cache/pixels/ in the run directory) that every stage and later run shares."""
        d = self.cfg.data
        place = pixel_place(self.run, d, DistEnv() if self.rank0_only else self.env)
        if d.name == "imagefolder":  # checked from the listing, before a single image is decoded
            from compress.data.imagefolder import scan

            for key, rel in self.state.sources.items():
                stage, _, output = key.partition(":")
                if output == "model":
                    try:
                        classes = read_metadata(self.run.path(rel)).get("class_names")
                    except CompressError:  # a damaged file: said in full when the stage loads it
                        continue
                    _refuse_other_classes(self.run.path(rel), classes, scan(d)["classes"], stage)
        return load_data(d, self.cfg.seed, unlabeled, place=place)

    def load_model(self, stage, model_name, data, output="model"):
        """Build `model_name` for the data's shape and load an upstream stage's weights (its `output`, on the
        CPU), checking sha256 against the manifest and the model name against the checkpoint's metadata."""
        model = build_model(model_name, data.input_shape, data.num_classes)
        path = self.input_path(stage, output)
        tensors, meta = read_weights(path, expect_stage=stage, expect_model=model_name,
                                     expect_sha256=self.input_sha256(stage, output))
        _refuse_other_classes(path, meta.get("class_names"), data.class_names, stage)
        load_into(model, tensors, path)
        return model, meta

    def weights_metadata(self, model_name, data, parent=None):
        """Metadata stored with a stage's final weights: enough to rebuild the model and its preprocessing."""
        return {"stage": self.stage, "model": model_name, "result_hash": self.state.result_hash,  # not config_hash:
                # a setting that cannot change the weights (data.cache_mb) leaves the file byte for byte the same
                "parent_sha256": parent or "", "input_shape": list(data.input_shape),
                "class_names": list(data.class_names), "mean": list(data.mean), "std": list(data.std),
                "dataset": data.name, "compress_version": __version__}

    def loaders(self, train_set, val_set, batch_size, key):
        """(train, val) loaders for this rank: the global batch split over the processes, DataLoader workers
        from train.num_workers, pinned memory on CUDA."""
        env, t = self.env, self.cfg.train
        per_rank = dist.per_rank_batch(batch_size, env, key)
        pin = env.device.type == "cuda"
        eval_workers = t.num_workers or 0  # the default's workers cut training crops; evaluation has none to cut
        return (train_loader(train_set, per_rank, env.rank, env.world, self.cfg.seed, self.workers, pin),
                eval_loader(val_set, t.eval_batch_size, env.rank, env.world, eval_workers, pin))

    @property
    def workers(self):
        """DataLoader worker processes per training process (train.num_workers, or its default here)."""
        return loader_workers(self.cfg.train.num_workers, self.env.device.type, self.env.local_world)[0]

    def precision(self, models, example, training=True, fixed=None, trained=None):
        """The training precision train.precision asks for on this hardware and for the models `trained` (default:
        all of `models`; distill's teacher only runs forward, so the student's layers decide), or `fixed`, a
        stage's own, with its reason; said once in the log with the threads and workers ('trains in', or
        'evaluates in' for a stage that only evaluates: `training` False), with all `models` placed in its memory
        layout (`example`: one input batch)."""
        precision = fixed or Precision.for_run(self.cfg.train.precision, self.env.device,
                                               models if trained is None else trained, example)
        precision = precision.place(models, example)
        threads = self.env.threads or "?"
        if self.env.check_neighbours:
            if _fit_threads_to_free_cores():
                threads = f"{torch.get_num_threads()} (the CPUs other processes leave free)"
        if self.env.is_main:
            workers, why = loader_workers(self.cfg.train.num_workers, self.env.device.type, self.env.local_world)
            name = precision.name if precision.dtype is None else f"{precision.name} autocast"
            log.info("%s: %s in %s (%s) on %s CPU thread(s) per process, %d DataLoader worker(s) (%s)",
                     self.stage, "trains" if training else "evaluates", name, precision.reason, threads, workers, why)
        return precision

    def session(self, modules, optimizer, steps_per_epoch, epochs, part="", precision=FP32, extra=None):
        """The loop's Session for one part of this stage: restored from its resume checkpoint when the state
        says so (`modules`, name -> unwrapped module, and the optimizer are loaded in place), saving to
        `<stage>[/<part>]/last/` and logging epochs to `<stage>[/<part>]/metrics.json`. `extra` is kept with
        every checkpoint (QAT's float-layer choice)."""
        env, name = self.env, f"{self.stage} {part}" if part else self.stage
        path = self.run.path(checkpoint_rel(self.stage, part))
        self.trained_by.setdefault(part, [])
        resume = self._restore(self.state.resume_of(part), path, modules, optimizer, steps_per_epoch, epochs, name,
                               part)

        def save(epoch, step, history, sums):  # every rank calls this at the same step
            if sums is not None:
                sums = reduce_sums(env, sums)
            if env.is_main:
                save_training_state(path, modules, optimizer, {
                    "stage": self.stage, "config_hash": self.state.config_hash, "result_hash": self.state.result_hash,
                    "inputs": self.state.inputs,
                    "epoch": epoch, "step": step, "history": history, "running": sums, "world_size": env.world,
                    "world_sizes": self._counts(part),
                    "threads": torch.get_num_threads(),
                    "best_val_acc": max((h["val_acc"] for h in history), default=None),
                    # the learning rate is a pure function of the global step and the RNG is re-seeded from
                    # (seed, stage, epoch, step, rank) every step: (epoch, step) restores both exactly
                    "global_step": epoch * steps_per_epoch + step,
                    "rng": {"reseeded_from": [self.cfg.seed, self.stage, epoch, step]}, "extra": extra or {}})
            dist.barrier(env)

        board = _Board(self.part_path(part, "tensorboard"), epochs) if env.is_main else None

        def log_epoch(history):
            if env.is_main:
                atomic_write_json(self.part_path(part, "metrics.json"), {"stage": name, "epochs": history})
                board.write(history[-1])

        return Session(env, name, precision, (self.cfg.seed, self.stage), resume, save,
                       self.cfg.train.checkpoint_every, log_epoch, self.cfg.train.progress,
                       clip_grad_norm=self.cfg.train.clip_grad_norm)

    def _counts(self, part):
        """The process counts that trained `part` so far, this run's last."""
        counts = self.trained_by.get(part, [])
        return counts if counts[-1:] == [self.env.world] else counts + [self.env.world]

    def world_sizes(self):
        """The process counts that trained this stage's parts, in order ([] when it trained nothing)."""
        counts = []
        for part in self.trained_by:
            for world in self._counts(part):
                if world not in counts:
                    counts.append(world)
        return counts

    def _restore(self, point, path, modules, optimizer, steps_per_epoch, epochs, name, part=""):
        if point is None:
            return ResumePoint()
        state = load_training_state(path, modules, optimizer)
        validate_resume_state(state, path, epochs, steps_per_epoch)
        earlier = state.get("world_sizes")
        if not isinstance(earlier, list):  # a checkpoint from before they were kept: the count that wrote it
            earlier = [state.get("world_size")]
        self.trained_by[part] = [w for w in earlier if type(w) is int and w >= 1]
        same_step = state["step"] == point.step
        if self.env.is_main:
            where = ("after its last epoch" if point.epoch >= epochs
                     else f"epoch {point.epoch + 1}, step {point.step}")
            log.info("%s: resuming from %s (%s)", name, point.path, where)
            then, now = state.get("threads"), torch.get_num_threads()
            if self.env.device.type == "cpu" and isinstance(then, int) and then != now and point.epoch < epochs:
                log.warning("%s: resuming on %d CPU thread(s) per process where it trained on %d so far: the result "
                            "differs in its last digits from a run on either count alone (train.threads fixes the "
                            "count)", name, now, then)
        # the epoch's running sums are global, counted on rank 0; they count only if we resume at their step
        running = state.get("running") if self.env.is_main and same_step else None
        return ResumePoint(point.epoch, point.step, state["history"], running)


_crowding_checked = []  # once per process: the first training stage looks, the later ones would repeat it


def _fit_threads_to_free_cores():
    """Other processes busy on our CPUs make every one of our threads wait for them: train on the free cores
    instead, and say so (0.2 s of /proc/stat, once, as the first training stage starts - after every input was
    checked). Only where compress chose the thread count (env.check_neighbours). Returns the new count, or None."""
    from compress.cpus import busy_elsewhere, crowding_note, threads_beside

    if _crowding_checked:
        return _crowding_checked[0]
    threads = torch.get_num_threads()
    busy = busy_elsewhere()
    fewer = threads_beside(threads, busy)
    _crowding_checked.append(fewer if fewer < threads else None)
    if fewer < threads:
        log.warning("%s", crowding_note(threads, busy))
        torch.set_num_threads(fewer)
    return _crowding_checked[0]


class _Board:
    """Per-epoch scalars (loss terms, accuracy, learning rate, images/s) in `folder` for TensorBoard, when it is
    installed (an optional extra); nothing otherwise. One event file per process, flushed every epoch."""

    def __init__(self, folder, epochs):
        self.folder, self.epochs, self.writer = folder, epochs, None
        self.enabled = importlib.util.find_spec("tensorboard") is not None

    def write(self, metrics):
        if not self.enabled:
            return
        if self.writer is not None and not os.path.isdir(self.folder):  # removed under the run: its writer thread
            self._give_up("its folder was removed")  # would fail on the next event with a traceback
            return
        try:
            if self.writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=self.folder)
            for key, value in metrics.items():
                if key != "epoch" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, metrics["epoch"])
            self.writer.flush()
        except OSError as e:  # TensorBoard is a view of the run, never a reason to fail it
            self._give_up(e.strerror or str(e))
            return
        if metrics["epoch"] >= self.epochs:
            self.writer.close()
            self.writer = None

    def _give_up(self, why):
        log.warning("TensorBoard scalars stop here (%s: %s); the training goes on", self.folder, why)
        self.enabled, writer, self.writer = False, self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as e:  # its thread's own failure: nothing more to save
                log.debug("closing the TensorBoard writer: %s", e)


def _refuse_other_classes(path, trained_on, classes, stage):
    """A model trained on other classes than the data's is refused (its class indices would mean others)."""
    if isinstance(trained_on, list) and trained_on != list(classes):
        raise InputError(f"'{path}' was trained on {classes_text(trained_on)}, but the data now has "
                         f"{classes_text(classes)}; run the {stage} stage again on these images (add {stage} "
                         "to --stages; with --force if it says it is up to date)")


def classes_text(names, most=6):
    """'3 classes (cat, dog, ship)', the first `most` names when there are more."""
    shown = ", ".join(map(str, names[:most])) + (f", ... {len(names) - most} more" if len(names) > most else "")
    return f"{len(names)} classes ({shown})"
