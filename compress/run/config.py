"""The config: YAML parsed once, at the edge, into frozen dataclasses. Training code never sees raw dicts.

The dataclass defaults *are* the default config (`configs/default.yaml` is a copy, and a test keeps them equal).
Precedence: `--set key=value` > config file (or the run directory's `config.yaml`) > these defaults.

Parsing is pure: it checks types, ranges and finiteness, imports no torch and touches no disk. Whether the
dataset folder exists and the model names resolve is checked by `compress.preflight`, one explicit step the
pipeline runs before it writes anything.
"""

import copy
import dataclasses
import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Optional

import yaml

from compress.data.registry import DATASETS
from compress.deploy.runtimes import RUNTIMES
from compress.deploy.runtimes import config_help as runtimes_help
from compress.distill.feature_losses import FEATURE_LOSSES
from compress.distill.logit_losses import LOGIT_LOSSES
from compress.errors import ConfigError, InputError
from compress.fileio import read_bytes
from compress.run import schema
from compress.run.contract import LEFT_OUT
from compress.run.schema import MIN_STD, problems_if

DATASET_NAMES = tuple(DATASETS)
MAX_SEED = 2**32 - 1
MIN_TEMPERATURE = 0.05  # a softmax temperature below it turns the softened outputs one-hot and overflows the loss
MAX_IMAGE_SIZE = 2048
MAX_BATCH = 65536
# a registry name, or <source or module>:<what it names> (each source checks its own names: models.registry.SOURCES)
_MODEL_SOURCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*(:[A-Za-z0-9_][A-Za-z0-9_./-]*)?$")


def outside(value, low, high):
    """`value` is not in [low, high] (the checks below read as `(outside(x, 1, 10), "x: ...")`)."""
    return value is not None and not low <= value <= high


def between(key, value, low, high):
    """The check `(value outside [low, high], "key: must be between low and high, got value")`: a limit is stated
    with both its ends."""
    return outside(value, low, high), f"{key}: must be between {_number(low)} and {_number(high)}, got {value}"


def _number(x):
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def _f(default, help):
    """A field with its help text (docs/configuration.md's reference is generated from these)."""
    if isinstance(default, (dict, list)) or hasattr(default, "__dataclass_fields__"):
        return field(default_factory=lambda: default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DataConfig:
    name: str = _f("mnist5k", "dataset: " + "; ".join(f"{name}: {dataset.description}"
                                                     for name, dataset in DATASETS.items()))
    root: Optional[str] = _f(None, "folder of the data: cifar10's local copy, or imagefolder's root: "
                                   "root/train/<class>/ with root/val/<class>/ (or training/; valid/, validation/, "
                                   "dev/, test/, testing/) as the splits, or a flat root/<class>/<image>")
    download: bool = _f(False, "cifar10 only: download into root if it is not there (needs network)")
    val_fraction: float = _f(0.1, "share of the data held out for validation when no split is given (mnist5k, "
                                  "digits, a flat imagefolder: that share of every class), chosen by split_seed")
    split_seed: int = _f(0, "seed of that train/validation split (fixed, so runs with different seeds compare "
                            "on the same images)")
    image_size: Optional[int] = _f(None, "square size the model sees; default: the dataset's own (imagefolder: 32)")
    channels: Optional[int] = _f(None, "imagefolder only: 1 (grayscale) or 3 (RGB, default)")
    mean: Optional[tuple[float, ...]] = _f(None, "per-channel normalisation mean; default: computed on the train split")
    std: Optional[tuple[float, ...]] = _f(None, "per-channel normalisation std; default: computed on the train split")
    augment: Literal["none", "pad_crop", "random_resized_crop"] = _f(
        "none", "training augmentation, seeded per (seed, epoch, image): pad_crop (zero-pad by crop_padding, random "
                "crop back), random_resized_crop (random area crop_scale and aspect 3/4..4/3, resized to image_size)")
    flip: Optional[bool] = _f(None, "random horizontal flip in training; default: on for "
                                    + " and ".join(n for n, d in DATASETS.items() if d.flip) + ", off for "
                                    + " and ".join(n for n, d in DATASETS.items() if not d.flip))
    crop_padding: int = _f(4, "pad_crop: pixels of zero padding on each side")
    crop_scale: tuple[float, ...] = _f((0.25, 1.0), "random_resized_crop: range of the crop's share of the image area")
    eval_crop: float = _f(1.0, "validation and deployment: resize the shorter side to image_size / eval_crop, then "
                               "centre-crop image_size (0.875 is the ImageNet convention)")
    cache_mb: int = _f(1024, "imagefolder: image files are decoded once, at the size training needs, into the run's "
                             "pixel cache (data.cache_dir); each set (training, validation, unlabelled) is read into "
                             "memory when it fits this many MB per process, else memory-mapped from disk")
    cache_dir: Optional[str] = _f(None, "imagefolder: folder of the decoded-pixel cache; default: cache/pixels/ in "
                                        "the run directory. Name one folder to share it between run directories")
    limit: Optional[int] = _f(None, "use only this many samples of the train split (quick trials)")
    unlabeled: Optional[str] = _f(None, "a folder of images without labels (nested folders allowed) that the distill "
                                        "stage trains on too: distillation losses there, cross-entropy where a "
                                        "label exists; the teacher and the student trained alone never see them")

    def __post_init__(self):
        reads_root = self.name in DATASETS and DATASETS[self.name].reads_root
        needs_root = reads_root and not (self.name == "cifar10" and self.download)
        problems_if([
            (self.name not in DATASET_NAMES,
             f"name: unknown dataset '{self.name}'; choose one of {', '.join(DATASET_NAMES)}"),
            (needs_root and not self.root, f"root: dataset '{self.name}' needs a root folder (data.root=PATH)"),
            (self.root is not None and self.name in DATASETS and not reads_root,
             f"root: '{self.root}' is not read: data.name is {self.name}, which brings its own images; to train on "
             "the images in that folder set data.name: imagefolder (--set data.name=imagefolder)"),
            (not 0.0 < self.val_fraction < 1.0,
             f"val_fraction: must be between 0 and 1, both excluded, got {self.val_fraction}"),
            (outside(self.image_size, 8, MAX_IMAGE_SIZE),
             f"image_size: must be between 8 and {MAX_IMAGE_SIZE}, got {self.image_size}"),
            (self.channels not in (None, 1, 3), f"channels: must be 1 or 3, got {self.channels}"),
            ((self.mean is None) != (self.std is None), "mean/std: give both or neither"),
            (self.mean is not None and self.std is not None and len(self.mean) != len(self.std),
             "mean/std: must have the same length"),
            (self.mean is not None and not 1 <= len(self.mean) <= 3, "mean: give 1 or 3 values (one per channel)"),
            (self.std is not None and any(outside(s, MIN_STD, 1 / MIN_STD) for s in self.std),
             f"std: every value must be between {MIN_STD:g} and {1 / MIN_STD:g} (pixels are scaled to 0..1: a smaller "
             f"std blows their steps up a thousandfold and more, and training gives NaN), got {list(self.std or ())}"),
            between("limit", self.limit, 10, 10**9),
            (outside(self.split_seed, 0, MAX_SEED),
             f"split_seed: must be between 0 and {MAX_SEED}, got {self.split_seed}"),
            (outside(self.crop_padding, 0, 512), f"crop_padding: must be between 0 and 512, got {self.crop_padding}"),
            (len(self.crop_scale) != 2 or not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1,
             f"crop_scale: give [low, high] with 0 < low <= high <= 1, got {list(self.crop_scale)}"),
            (not 0.25 <= self.eval_crop <= 1, f"eval_crop: must be between 0.25 and 1, got {self.eval_crop}"),
            between("cache_mb", self.cache_mb, 0, 10**7),
        ])


@dataclass(frozen=True)
class ModelConfig:
    teacher: str = _f("resnet14", "teacher: a registry name (`compress models`), torchvision:<builder> (e.g. "
                                  "torchvision:resnet50) or <module>:<function> (your own code)")
    student: str = _f("compact_cnn", "student: a registry name, torchvision:<builder> or <module>:<function>")
    teacher_weights: Optional[str] = _f(None, "start the teacher from a .safetensors or state-dict (.pth/.pt) file, or "
                                              "torchvision's weights by name: pretrained (the model's default) or "
                                              "torchvision:IMAGENET1K_V1 (found in torch's cache, $TORCH_HOME, or "
                                              "downloaded there); with teacher.epochs: 0 it is used as is")
    student_weights: Optional[str] = _f(None, "start the student from a weights file or torchvision weights name, as "
                                              "model.teacher_weights")

    def __post_init__(self):
        problems_if([(not _MODEL_SOURCE.match(name),
                      f"{key}: '{name}' is not a model name; use a registry name (`compress models`), "
                      "torchvision:<builder> or <module>:<function>")
                     for key, name in (("teacher", self.teacher), ("student", self.student))])


@dataclass(frozen=True)
class TrainConfig:
    """How to run, not what to compute: changing these never invalidates a finished stage."""

    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto picks cuda when available (nccl), else cpu (gloo)")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _f(
        "auto", "teacher and distill training: auto = bf16 autocast on CUDA (fp16 with gradient scaling where bf16 "
                "is missing) and on a CPU that computes bf16 natively (avx512_bf16, amx_bf16), fp32 on other CPUs "
                "and for convolutional models built on depthwise convolutions (MobileNets, EfficientNets: slower in "
                "bf16 on a CPU); channels-last on both; QAT always trains in fp32")
    threads: Optional[int] = _f(None, "torch threads per process; default: OMP_NUM_THREADS if you set it (one "
                                      "process), else the CPUs this process may use (its affinity: taskset, cpuset, "
                                      "SLURM) / processes on this node; set 1 beside another busy process")
    eval_batch_size: int = _f(500, "batch size for evaluation")
    num_workers: Optional[int] = _f(None, "DataLoader worker processes per training process (they cut and augment the "
                                          "images; the pixels are the same with any number); null: 0 on a CPU, whose "
                                          "cores the training step needs, and on CUDA this process's CPUs - 1, at "
                                          "most 8, to keep the GPU fed (0 where /dev/shm, through which they hand "
                                          "over batches, is under 1 GB, as a container's default 64 MB is, or where "
                                          "the temporary folder's path is too long for their sockets: over 75 "
                                          "characters); "
                                          "evaluation, with nothing to augment, then runs in the process")
    checkpoint_every: int = _f(0, "also write the resume checkpoint every N steps (0: at the end of each epoch)")
    progress: bool = _f(True, "show a progress bar on rank 0 when stderr is a terminal, else a log line every 30 s; "
                              "false: neither")
    clip_grad_norm: Optional[float] = _f(None, "teacher, distill and QAT training: scale the gradients down to this "
                                               "global L2 norm before each update where theirs is larger (torch's "
                                               "clip_grad_norm_), a guard against the rare batch whose gradients "
                                               "blow up; null: never")

    def __post_init__(self):
        problems_if([
            (self.clip_grad_norm is not None and not 0 < self.clip_grad_norm <= 1e6,
             f"clip_grad_norm: must be in (0, 1,000,000], or null for no clipping, got {self.clip_grad_norm}"),
            (outside(self.threads, 1, 1024), f"threads: must be between 1 and 1024, got {self.threads}"),
            (outside(self.eval_batch_size, 1, MAX_BATCH),
             f"eval_batch_size: must be between 1 and {MAX_BATCH}, got {self.eval_batch_size}"),
            (outside(self.num_workers, 0, 256),
             f"num_workers: must be between 0 and 256, or null for the default, got {self.num_workers}"),
            between("checkpoint_every", self.checkpoint_every, 0, 10**9),
        ])


@dataclass(frozen=True)
class OptimConfig:
    """Fields shared by the three training stages; each stage has its own copy with its own defaults."""

    epochs: int = _f(3, "training epochs")
    batch_size: int = _f(64, "global batch size, split evenly over processes")
    optimizer: Literal["adam", "adamw", "sgd"] = _f("adam", "optimizer")
    lr: float = _f(1e-3, "peak learning rate")
    momentum: float = _f(0.9, "SGD momentum")
    nesterov: bool = _f(False, "SGD: Nesterov momentum")
    label_smoothing: float = _f(0.0, "label smoothing of the cross-entropy on labels")
    weight_decay: float = _f(0.0, "weight decay")
    norm_weight_decay: Optional[float] = _f(None, "weight decay of the 1-D parameters (normalisation layers' scales "
                                                  "and shifts, biases); null: weight_decay. 0 is the usual choice "
                                                  "with adamw's larger decay (torchvision's --norm-weight-decay)")
    schedule: Literal["cosine", "step", "constant"] = _f("cosine", "learning-rate schedule, stepped every batch")
    warmup_epochs: float = _f(0.0, "linear learning-rate warm-up from 0 over this many epochs, then the schedule")
    step_size: int = _f(1, "step schedule: epochs between decays")
    gamma: float = _f(0.1, "step schedule: decay factor")

    def __post_init__(self):
        problems_if(self._optim_checks())

    def _optim_checks(self, min_epochs=1):
        return [
            (outside(self.epochs, min_epochs, 100_000),
             f"epochs: must be between {min_epochs} and 100000, got {self.epochs}"),
            (outside(self.batch_size, 1, MAX_BATCH),
             f"batch_size: must be between 1 and {MAX_BATCH}, got {self.batch_size}"),
            (not 0 < self.lr <= 1e4, f"lr: must be in (0, 10000], got {self.lr}"),
            (not 0 <= self.momentum < 1, f"momentum: must be in [0, 1), got {self.momentum}"),
            (outside(self.weight_decay, 0, 10), f"weight_decay: must be between 0 and 10, got {self.weight_decay}"),
            (outside(self.norm_weight_decay, 0, 10),
             f"norm_weight_decay: must be between 0 and 10, or null, got {self.norm_weight_decay}"),
            between("step_size", self.step_size, 1, 100_000),
            (not 0 <= self.label_smoothing < 1, f"label_smoothing: must be in [0, 1), got {self.label_smoothing}"),
            (self.epochs > 0 and not 0 <= self.warmup_epochs <= self.epochs,
             f"warmup_epochs: must be between 0 and epochs ({self.epochs}), got {self.warmup_epochs}"),
            (not 0 < self.gamma <= 1, f"gamma: must be in (0, 1], got {self.gamma}"),
        ]


@dataclass(frozen=True)
class SGDRecipe(OptimConfig):
    """The defaults of the teacher and distill stages: SGD with Nesterov momentum and weight decay, a 1-epoch
    linear warm-up, then cosine (He et al. 2016's CIFAR recipe with a warm-up; it trains the default student
    to the same accuracy whatever the seed, where Adam left it under-trained and seed-dependent)."""

    optimizer: Literal["adam", "adamw", "sgd"] = _f("sgd", "optimizer")
    lr: float = _f(0.1, "peak learning rate")
    nesterov: bool = _f(True, "SGD: Nesterov momentum")
    weight_decay: float = _f(5e-4, "weight decay")
    warmup_epochs: float = _f(1.0, "linear learning-rate warm-up from 0 over this many epochs, then the schedule")
    mix: Literal["none", "mixup", "cutmix"] = _f(
        "none", "mix each training image with a partner image (its label weighted by its share): mixup blends "
                "them, cutmix pastes a box of the partner; in distill the teacher sees the very same mixed pixels")
    mix_alpha: float = _f(1.0, "mixup: lam ~ Beta(mix_alpha, mix_alpha) (cutmix draws the box area uniformly)")

    def __post_init__(self):
        problems_if(self._recipe_checks())

    def _recipe_checks(self, min_epochs=1):
        return self._optim_checks(min_epochs) + [
            (not 0 < self.mix_alpha <= 100, f"mix_alpha: must be in (0, 100], got {self.mix_alpha}")]


@dataclass(frozen=True)
class TeacherConfig(SGDRecipe):
    epochs: int = _f(4, "training epochs (0: use model.teacher_weights as is, only evaluated)")

    def __post_init__(self):
        problems_if(self._recipe_checks(min_epochs=0))


@dataclass(frozen=True)
class DKDConfig:
    alpha: float = _f(1.0, "dkd: weight of the target-class term (TCKD)")
    beta: float = _f(8.0, "dkd: weight of the non-target-class term (NCKD)")
    warmup_epochs: float = _f(20.0, "dkd: the loss weight rises linearly from 0 over this many epochs")

    def __post_init__(self):
        problems_if([between("alpha", self.alpha, 0, 1e6),
                     between("beta", self.beta, 0, 1e6),
                     between("warmup_epochs", self.warmup_epochs, 0, 1e5)])


@dataclass(frozen=True)
class DISTConfig:
    beta: float = _f(1.0, "dist: weight of the inter-class relation (per-sample Pearson correlation)")
    gamma: float = _f(1.0, "dist: weight of the intra-class relation (per-class correlation over the batch)")

    def __post_init__(self):
        problems_if([between("beta", self.beta, 0, 1e6),
                     between("gamma", self.gamma, 0, 1e6)])


def _paper(field):
    return ", ".join(f"{name} {loss.paper[field]:g}" for name, loss in LOGIT_LOSSES.items())


@dataclass(frozen=True)
class KDConfig:
    method: Literal[tuple(LOGIT_LOSSES)] = _f(
        "standardized", "logit loss: " + ", ".join(f"{name} ({loss.summary})" for name, loss in LOGIT_LOSSES.items()))
    weight: Optional[float] = _f(None, f"weight of the logit loss; 0 turns it off; null: the method's paper weight "
                                       f"({_paper('weight')})")
    temperature: Optional[float] = _f(None, f"softmax temperature T; null: the method's paper default "
                                            f"({_paper('temperature')}; standardized's 2 was set for 100 classes: with "
                                            "10, T 1 measured better)")
    dkd: DKDConfig = _f(DKDConfig(), "")
    dist: DISTConfig = _f(DISTConfig(), "")

    def __post_init__(self):
        problems_if([between("weight", self.weight, 0, 1e6),
                     (self.temperature is not None and not MIN_TEMPERATURE <= self.temperature <= 1000,
                      f"temperature: must be between {MIN_TEMPERATURE} and 1000, or null, got {self.temperature} (a "
                      "smaller one makes the softened outputs one-hot and the loss overflow)")])

    @property
    def loss(self):
        return LOGIT_LOSSES[self.method]

    @property
    def resolved_temperature(self):
        return self.temperature if self.temperature is not None else self.loss.paper["temperature"]

    @property
    def resolved_weight(self):
        return self.weight if self.weight is not None else self.loss.paper["weight"]

    @property
    def params(self):
        """The method's own parameters ({} when it has none): its section under distill.kd, as a dict."""
        return dataclasses.asdict(getattr(self, self.loss.params)) if self.loss.params else {}


@dataclass(frozen=True)
class StoreConfig:
    enabled: bool = _f(True, "keep the teacher's outputs for every (image, view) on disk (distill/teacher_outputs/), "
                             "built once and reused by every later distill run with the same teacher, images and "
                             "views; false: the teacher runs on every batch (it always does with a hint loss, whose "
                             "feature maps are not stored)")
    top_k: Optional[int] = _f(None, "logits kept per (image, view): the top k in fp16 with their indices (the rest "
                                    "spread evenly); null: all of them up to 100 classes, else 10")

    def __post_init__(self):
        problems_if([between("top_k", self.top_k, 1, 100_000)])


@dataclass(frozen=True)
class CosineConfig:
    weight: float = _f(0.0, "weight of CosineEmbeddingLoss between hidden representations; 0 turns it off")
    teacher_layer: str = _f("pool", "teacher module whose output is compared (name from `named_modules`)")
    student_layer: str = _f("pool", "student module whose output is compared")

    def __post_init__(self):
        problems_if([between("weight", self.weight, 0, 1e6)])


@dataclass(frozen=True)
class HintConfig:
    weight: float = _f(0.0, "weight of the FitNets hint loss (MSE after a trainable regressor); 0 turns it off; with a "
                       "hint the teacher runs on every batch (its feature maps are not stored)")
    teacher_layer: str = _f("layers", "teacher module giving the hint")
    student_layer: str = _f("block2", "student module that learns it")
    regressor: Literal["conv3x3", "conv1x1", "linear"] = _f(
        "conv3x3", "regressor from student to teacher shape (linear flattens the features)")

    def __post_init__(self):
        problems_if([between("weight", self.weight, 0, 1e6)])


@dataclass(frozen=True)
class DistillConfig(SGDRecipe):
    epochs: int = _f(8, "training epochs")
    lr: float = _f(0.05, "peak learning rate")
    ce_weight: Optional[float] = _f(None, "weight of cross-entropy on the labels; null: the one kd.method's paper "
                                          f"uses beside it ({_paper('ce_weight')})")
    kd: KDConfig = _f(KDConfig(), "the logit loss: knowledge distillation from the teacher's logits")
    cosine: CosineConfig = _f(CosineConfig(), "cosine loss on hidden representations")
    hint: HintConfig = _f(HintConfig(), "FitNets hint")
    views: Optional[int] = _f(None, "fixed augmented views per image; epoch e shows view e mod views, the teacher "
                                    "sees the very pixels the student does, and its outputs are stored per view; "
                                    "null: as many as epochs (a fresh view every epoch); never more views than epochs, "
                                    "and one without augmentation (the log says when fewer are used)")
    view_seed: int = _f(0, "seed of those views (crops, flips, mixing partners), apart from `seed` so that runs "
                           "with another training seed reuse the stored teacher outputs")
    store: StoreConfig = _f(StoreConfig(), "")
    baseline: bool = _f(True, "also train the student alone (CE only, same initialisation, schedule, seed and "
                              "augmented views, labelled images only) so the report states what distillation gained; "
                              "a rerun that changes only the teacher, the distillation losses or where and how the "
                              "images are held (data.cache_mb, data.cache_dir) reuses it")

    def __post_init__(self):
        problems_if(self._recipe_checks() + [
            between("ce_weight", self.ce_weight, 0, 1e6),
            (sum(self.loss_weights().values()) <= 0,
             f"ce_weight, kd.weight, {', '.join(f'{name}.weight' for name in FEATURE_LOSSES)}: at least one must be "
             "> 0"),
            (outside(self.views, 1, 100_000),
             f"views: must be between 1 and 100,000, or null for one per epoch, got {self.views} (the teacher on every "
             "batch is distill.store.enabled: false)"),
            (outside(self.view_seed, 0, MAX_SEED),
             f"view_seed: must be between 0 and {MAX_SEED}, got {self.view_seed}"),
        ])

    @property
    def resolved_ce_weight(self):
        return self.ce_weight if self.ce_weight is not None else self.kd.loss.paper["ce_weight"]

    def loss_weights(self):
        """{term: weight} of the four distillation terms, nulls resolved; a term of weight 0 is off."""
        return {"ce": self.resolved_ce_weight, "kd": self.kd.resolved_weight,
                **{name: getattr(self, name).weight for name in FEATURE_LOSSES}}

    def views_for(self, augmented):
        """How many views each image has: 1 without augmentation (every epoch shows the same image), and never
        more than the epochs that show them (a view no epoch shows would cost the teacher's time for nothing; a
        later, longer run extends the store)."""
        if not augmented:
            return 1
        return min(self.views or self.epochs, self.epochs)


@dataclass(frozen=True)
class QATConfig(OptimConfig):
    epochs: int = _f(2, "fine-tuning epochs")
    lr: float = _f(1e-4, "peak learning rate (QAT is a short, gentle fine-tune)")
    source: Literal["distill", "baseline", "teacher"] = _f(
        "distill", "the float model to quantize and ship: distill (the distilled student), baseline (the student "
                   "trained alone, with distill.baseline) or teacher")
    backend: Literal["x86", "qnnpack"] = _f("x86", "quantized engine: x86 (fbgemm, servers/desktops) or qnnpack (ARM)")
    activation_range: Literal["full", "reduced"] = _f(
        "full", "full: activations 0..255 (int8 matches fake-quant); reduced: 0..127 (x86 default, drifts)")
    per_channel: bool = _f(True, "per-channel symmetric int8 weights (else per-tensor)")
    float_layers: Optional[tuple[str, ...]] = _f(
        None, "layers (module names) to keep in float; null: chosen before training from onnxruntime timings of "
              "the student (the stem, classifier or depthwise convs stay float where that makes the student at least "
              "5% faster; a float stem may grow into a longer float prefix); "
              "[]: quantize every layer")
    freeze_observers_after: int = _f(1, "stop updating quantization ranges after this many epochs")
    freeze_bn_after: int = _f(1, "freeze batch-norm statistics after this many epochs")
    max_accuracy_drop: float = _f(1.0, "fail the stage if int8 accuracy is more than this many points below float "
                                       "(a judgement: changed alone it retrains nothing - a stage whose model it now "
                                       "fails, or that failed it, judges that model again from its last checkpoint)")
    ce_weight: float = _f(1.0, "weight of the cross-entropy on labels")
    kd_weight: float = _f(1.0, "weight of distillation from the float model being quantized (frozen, run on every "
                               "batch): T^2 KL(softmax(float/T) || softmax(fake-quant/T)); it keeps what distillation "
                               "taught, which labels alone pull away from; 0: labels only")
    kd_temperature: float = _f(1.0, "temperature T of qat.kd_weight's distillation")

    def __post_init__(self):
        problems_if(self._optim_checks() + [
            (self.ce_weight < 0 or self.kd_weight < 0 or self.ce_weight + self.kd_weight <= 0,
             f"ce_weight, kd_weight: must be >= 0 and not both 0, got {self.ce_weight} and {self.kd_weight}"),
            (not MIN_TEMPERATURE <= self.kd_temperature <= 1000,
             f"kd_temperature: must be between {MIN_TEMPERATURE} and 1000, got {self.kd_temperature}"),
            (outside(self.freeze_observers_after, 1, 100_000),
             f"freeze_observers_after: must be between 1 and 100,000 (observers need one epoch to learn ranges), got "
             f"{self.freeze_observers_after}"),
            between("freeze_bn_after", self.freeze_bn_after, 0, 100_000),
            (outside(self.max_accuracy_drop, 0, 100),
             f"max_accuracy_drop: must be between 0 and 100 (points), got {self.max_accuracy_drop}"),
        ])


@dataclass(frozen=True)
class ExportConfig:
    opset: int = _f(21, "ONNX opset (13-21); 19 and newer let onnx's reference evaluator run the int8 file")
    fp32_max_abs_diff: float = _f(1e-3, "fail if fp32 ONNX logits differ from PyTorch by more than this: absolute "
                                        "where an image's largest absolute logit is at most 1, else a share of it "
                                        "(float32 rounding grows with the numbers)")
    fp32_min_agreement: float = _f(1.0, "fail if fp32 ONNX top-1 agrees with PyTorch on less than this share")
    int8_min_agreement: float = _f(0.99, "fail if int8 ONNX top-1 agrees with PyTorch int8 on less than this share "
                                    "(a pick within 2 steps of the logits' 8-bit resolution counts as a tie)")
    latency_batch_sizes: tuple[int, ...] = _f((1, 64), "batch sizes for the latency table")
    latency_repeats: int = _f(30, "most timed runs of a file in each of a latency cell's 5 interleaved rounds (11 when "
                                  "the verdict times a cell again; each round at most 0.05 s a file; reported: the "
                                  "median of the rounds' fastest runs)")
    latency_warmup: int = _f(5, "untimed runs before timing")
    latency_threads: Optional[tuple[int, ...]] = _f(
        None, "thread counts the latency table times; null: 1 and every usable core. The verdict and the qat "
              "stage's float-layer choice weigh the most threads listed: exporting on a bigger machine than the one "
              "you deploy to, give the target's (e.g. [1, 2] for a 2-core device)")
    runtimes: Optional[tuple[Literal[tuple(RUNTIMES)], ...]] = _f(None, runtimes_help())
    min_int8_speedup: float = _f(1.0, "the int8 file is the one to deploy when it is at least this much faster than "
                                      "fp32 in the first runtime (the latency table's cell of the largest batch on "
                                      "the most threads timed); else the fp32 file is, and the report says why")
    require_faster_int8: bool = _f(False, "fail the stage (exit 1, every file kept) instead of recommending the fp32 "
                                          "file when int8 is not min_int8_speedup times faster")
    ptq: bool = _f(True, "also quantize the float model with onnxruntime's post-training static quantization "
                         "(model.ptq.onnx: the shortcut a user could take instead of QAT) and measure it beside "
                         "the QAT file")
    ptq_calibration: int = _f(512, "training images that calibrate the post-training quantization")

    def __post_init__(self):
        problems_if([
            (not 13 <= self.opset <= 21, f"opset: must be between 13 and 21, got {self.opset}"),
            (not 0 <= self.min_int8_speedup <= 100,
             f"min_int8_speedup: must be between 0 and 100, got {self.min_int8_speedup}"),
            between("ptq_calibration", self.ptq_calibration, 1, 1_000_000),
            (self.runtimes is not None and (not self.runtimes or len(set(self.runtimes)) != len(self.runtimes)),
             "runtimes: give each runtime once, or null for the default"),
            (not 0 < self.fp32_max_abs_diff <= 1e6,
             f"fp32_max_abs_diff: must be in (0, 1e6], got {self.fp32_max_abs_diff}"),
            (not 0 <= self.fp32_min_agreement <= 1,
             f"fp32_min_agreement: must be in [0, 1], got {self.fp32_min_agreement}"),
            (not 0 <= self.int8_min_agreement <= 1,
             f"int8_min_agreement: must be in [0, 1], got {self.int8_min_agreement}"),
            (not self.latency_batch_sizes or any(outside(b, 1, 4096) for b in self.latency_batch_sizes),
             "latency_batch_sizes: give batch sizes between 1 and 4096"),
            between("latency_repeats", self.latency_repeats, 1, 100_000),
            between("latency_warmup", self.latency_warmup, 0, 10_000),
            (self.latency_threads is not None
             and (not self.latency_threads or any(outside(t, 1, 1024) for t in self.latency_threads)),
             "latency_threads: give thread counts between 1 and 1024, or null for 1 and every usable core"),
            (self.latency_threads is not None and len(set(self.latency_threads)) != len(self.latency_threads),
             f"latency_threads: give each thread count once, got {list(self.latency_threads or ())}"),
        ])


@dataclass(frozen=True)
class Config:
    seed: int = _f(0, "seed for the data split, initialisation, shuffling, augmentation and dropout")
    data: DataConfig = _f(DataConfig(), "")
    model: ModelConfig = _f(ModelConfig(), "")
    train: TrainConfig = _f(TrainConfig(), "")
    teacher: TeacherConfig = _f(TeacherConfig(), "")
    distill: DistillConfig = _f(DistillConfig(), "")
    qat: QATConfig = _f(QATConfig(), "")
    export: ExportConfig = _f(ExportConfig(), "")

    def __post_init__(self):
        problems_if([
            (outside(self.seed, 0, MAX_SEED), f"seed: must be between 0 and {MAX_SEED}, got {self.seed}"),
            (self.teacher.epochs == 0 and not self.model.teacher_weights,
             "teacher.epochs: 0 means \"use the given teacher as is\"; set model.teacher_weights to its file"),
        ])


RENAMED = {  # keys that earlier versions accepted: say what became of them instead of "unknown key"
    "distill.cache_teacher": "is now distill.store.enabled (the teacher's outputs are stored on disk and reused)",
    "distill.cache_mb": "is gone: the teacher-output store lives on disk (distill.store; its size is checked "
                        "against the free space)",
}


def load_config(path=None, overrides=(), follow_links=True, run_config=False):
    """Read a YAML file (or start from the defaults), apply `key.path=value` overrides, validate everything.
    Relative paths typed in a --set or a -c file (PATH_KEYS) become absolute, so the run's config.yaml names the
    same folders and files from wherever a later command runs; a run's own config.yaml (`run_config`) is read as
    saved."""
    raw = read_yaml(path, follow_links) if path else {}
    if not run_config:
        _absolute_paths(raw)
    sections = [f.name for f in dataclasses.fields(Config)]
    if len(raw) > 3 and not any(str(key).split(".")[0] in sections for key in raw):  # its lines are not echoed back
        raise ConfigError([f"none of its {len(raw)} top-level keys is a config section ({', '.join(sections)}); is "
                           "it really a compress config?"], source=path)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set '{item}': expected KEY=VALUE, e.g. --set teacher.epochs=5"])
        try:
            value = parse_yaml(text, f"--set {key.strip()}") if text.strip() else None
        except yaml.YAMLError:
            value = text
        if isinstance(value, str) and value != text.strip() and not text.strip().startswith(("'", '"')) \
                and not _numeric_text(value):  # (YAML 1.1 reads 1e-3 as text: `1e-3 # lower` stays the number)
            value = text.strip()  # YAML would cut or rewrite it (`/photos #2` loses ` #2`): text as typed
        elif isinstance(value, (dict, list)) and schema.takes_text_only(Config, key.strip()) \
                and not text.strip().startswith(("{", "[")):
            value = text.strip()  # a path with ': ' in it (`/photos/trip: day 1`) is a path, not a mapping
        section = schema.section_type(Config, key.strip()) if value is None else None
        if section:
            example = f"{key.strip()}.{dataclasses.fields(section)[0].name}"
            raise ConfigError([f"'{key.strip()}' is a section, and an empty value would reset every key in it to "
                               f"the defaults; set a key inside it (e.g. --set {example}=...), "
                               f"or --set {key.strip()}={{}} to reset it on purpose"], source="--set")
        schema.set_path(raw, key.strip(), _absolute(key.strip(), value))
    renamed = [f"'{key}' {what}; update the config" for key, what in RENAMED.items()
               if schema.get_path(raw, key, None) is not None]
    if renamed:
        raise ConfigError(renamed, source=path)
    try:
        return schema.build(Config, raw)
    except ConfigError as e:
        raise _named_by_origin(e.problems, path, [item.partition("=")[0].strip() for item in overrides]) from None


PATH_KEYS = ("data.root", "data.unlabeled", "data.cache_dir", "model.teacher_weights", "model.student_weights")


def _weights_name(value):
    from compress.models.weights import is_weights_name

    return is_weights_name(value)


def _absolute(key, value):
    """`value` of `key` as a path from the current folder when it is a relative path of PATH_KEYS ('~/photos' and
    weights torchvision names, such as 'pretrained', stay as typed)."""
    if key not in PATH_KEYS or not isinstance(value, str) or not value or value.startswith("~") \
            or os.path.isabs(value) or _weights_name(value):
        return value
    return os.path.abspath(value)


def _absolute_paths(raw):
    for key in PATH_KEYS:
        value = schema.get_path(raw, key, None)
        if value is not None and isinstance(raw.get(key.split(".")[0]), dict):
            schema.set_path(raw, key, _absolute(key, value))


def _numeric_text(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def _named_by_origin(problems, path, set_keys):
    """The error names where each refused value came from: the config file, or --set (which wins over the file,
    so a bad --set value is no reason to open the file)."""
    def from_set(problem):
        unknown = re.match(r"unknown key '([^']*)'", problem)
        head = unknown.group(1) if unknown else problem.split(":", 1)[0]
        section, _, names = head.rpartition(".")
        heads = [f"{section}.{n}" if section else n for n in names.split("/")]  # 'data.mean/std': either key
        return head in set_keys or any(h == k or h.startswith((f"{k}.", f"{k}[")) or k.startswith(f"{h}.")
                                       for k in set_keys for h in heads)  # 'data.mean[0]': an item of a list --set gave
    if problems and all(from_set(p) for p in problems):
        return ConfigError(problems, source="--set")
    return ConfigError([f"{p} (from --set)" if from_set(p) else p for p in problems], source=path)


MAX_YAML_BYTES = 16 * 2**20  # a config is kilobytes
MAX_YAML_DEPTH = 32  # levels of nesting: a config nests 3 or 4
MAX_YAML_VALUES = 100_000  # values in the tree once aliases are expanded: a config holds a few hundred


def read_yaml(path, follow_links=True):
    """The mapping a YAML config file holds ({} when empty): a regular file (a pipe is refused, not waited on;
    a symbolic link too unless `follow_links`, as for a run directory's own config.yaml), UTF-8, aliases bounded
    and keys unique (`parse_yaml`)."""
    if not os.path.lexists(path):
        raise InputError(f"config file '{path}' not found; pass an existing YAML file with --config")
    if os.path.isdir(path):
        raise InputError(f"config file '{path}' is a directory; pass a YAML file with --config")
    too_large = f"config file '{path}' is over {MAX_YAML_BYTES:,} bytes, far more than a config; is it really one?"
    data = read_bytes(path, "config file", limit=MAX_YAML_BYTES, follow_links=follow_links, too_large=too_large)
    if len(data) > MAX_YAML_BYTES:  # grew while read (a special file posing as regular)
        raise InputError(too_large)
    try:
        raw = parse_yaml(data.decode("utf-8"), path)
    except UnicodeDecodeError:
        raise ConfigError(["the file is not UTF-8 text; is it really a YAML config?"], source=path) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError([f"YAML syntax error{where}: {reason}"], source=path) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError([f"expected a mapping of sections (data:, teacher:, ...), got {type(raw).__name__}"],
                          source=path)
    return raw


def parse_yaml(text, source=None):
    """`yaml.safe_load(text)`, after checking the node tree it composes (nothing constructed yet): aliases must not
    expand it beyond MAX_YAML_VALUES values (nine levels of nine aliases are 387 million, which every later walk
    of the config would visit) nor refer to themselves, and no mapping may hold a key twice. Each check visits
    each distinct node once, so it costs the size of the text, not of the expansion."""
    deep = ConfigError([f"its values nest more than {MAX_YAML_DEPTH} levels deep (a config nests 3 or 4); write "
                        "them out flat"], source=source)
    try:  # PyYAML composes recursively: thousands of nested brackets exhaust Python's stack
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise deep from None
    if root is None:
        return None
    if _depth(root) > MAX_YAML_DEPTH:  # every later walk of the config recurses too
        raise deep
    size = _expanded_size(root, source)
    if size > MAX_YAML_VALUES:
        raise ConfigError([f"its YAML aliases (*name) expand to more than {MAX_YAML_VALUES:,} values (a config holds "
                           "a few hundred); write the values out, or use fewer aliases"], source=source)
    _refuse_misread_yaml(root, source)
    return yaml.safe_load(text)


def _children(node):
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _depth(root):
    """How deeply the node tree nests (each distinct node once; aliases were bounded by the caller)."""
    deepest, seen, stack = 0, set(), [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in _children(node))
    return deepest


def _expanded_size(root, source):
    """Values in the tree rooted at `root` with every alias expanded, counted up to a little past MAX_YAML_VALUES
    (depth first, each distinct node once); a node that contains itself is refused."""
    sizes, open_nodes, stack = {}, set(), [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = min(1 + sum(sizes[id(c)] for c in _children(node)), MAX_YAML_VALUES + 1)
            continue
        if key in sizes:
            continue
        if key in open_nodes:  # an ancestor of itself: `&a [*a]`
            mark = node.start_mark
            raise ConfigError([f"the YAML alias at line {mark.line + 1} refers to a value that contains it; write "
                               "the value out"], source=source)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


SEXAGESIMAL_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
INT_TAG = "tag:yaml.org,2002:int"
OTHER_BASE = re.compile(r"[-+]?0(b[01_]+|[0-7_]+)$")  # octal and binary; 0x (hex) is unambiguous


def _refuse_misread_yaml(root, path):
    """YAML lets a mapping hold a key twice and keeps the last one; a config that sets `epochs:` twice almost
    always means one of them is a mistake. A plain number with a colon (YAML 1.1's base 60: `seed: 12:30` is 750)
    is refused too. Checked on the node tree, each distinct node once (an alias is the
    node it names: checked where it is defined)."""
    stack, seen_nodes = [(root, "")], set()
    while stack:
        node, prefix = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else str(key.value)
                where = f"{prefix}.{name}" if prefix else name
                if name in seen:
                    raise ConfigError([f"key '{where}' appears twice (lines {seen[name]} and "
                                       f"{key.start_mark.line + 1}); keep one"], source=path)
                seen[name] = key.start_mark.line + 1
                stack.append((value, where))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, prefix) for item in node.value)
        elif node.tag in SEXAGESIMAL_TAGS and ":" in str(node.value):  # YAML 1.1 reads 12:30 as 750
            raise ConfigError([f"{prefix + ': ' if prefix else ''}'{node.value}' reads as a base-60 number in YAML ("
                               f"{yaml.safe_load(node.value)}); write the number itself, or quote it if text is "
                               "meant"], source=path)
        elif node.tag == INT_TAG and OTHER_BASE.match(str(node.value)):  # YAML 1.1 reads 010 as 8, 0b11 as 3
            raise ConfigError([f"{prefix + ': ' if prefix else ''}'{node.value}' reads as a number in another base "
                               f"in YAML ({yaml.safe_load(node.value)}); write it without the leading 0 (or 0b), or "
                               "quote it if text is meant"], source=path)


def dump_config(cfg):
    return yaml.safe_dump(schema.to_dict(cfg), sort_keys=False)


def config_slice(cfg, keys):
    """The parts of the config a stage depends on, by dotted key ('data', 'model.teacher', ...); a key written
    '-data.unlabeled' leaves that part out of the one above it."""
    if isinstance(cfg, ConfigView):  # a stage's view: only keys it may read (the read raises if not), then whole
        assert object.__getattribute__(cfg, "_path") == "", "a slice of the whole config's view only"
        for key in keys:
            if not key.startswith(LEFT_OUT):
                functools.reduce(getattr, key.split("."), cfg)
        cfg = object.__getattribute__(cfg, "_cfg")
    whole = schema.to_dict(cfg)
    picked = {key: copy.deepcopy(schema.get_path(whole, key)) for key in keys if not key.startswith(LEFT_OUT)}
    for key in keys:
        if key.startswith(LEFT_OUT):
            parent = next(k for k in picked if key[len(LEFT_OUT):].startswith(k + "."))
            node = picked[parent]
            parts = key[len(LEFT_OUT) + len(parent) + 1:].split(".")
            for part in parts[:-1]:
                node = node[part]
            node.pop(parts[-1])
    return picked


def section_hash(cfg, keys):
    """Stable hash of `config_slice(cfg, keys)`: what decides whether a finished stage is still up to date."""
    blob = json.dumps(config_slice(cfg, keys), sort_keys=True, allow_nan=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


NO_RESULT = ("cache_mb", "cache_dir", "download")  # how images are held or fetched, never which they are
# keys that judge a stage's result and change nothing in it: a stage that failed its budget, rerun with the budget
# its message advises, continues from its last checkpoint and judges the same model again instead of retraining
JUDGES_RESULT = {"qat": {"max_accuracy_drop": "accuracy_drop"}}  # section -> {key: the metric it bounds}
# keys whose null reproduces what ran before they existed
AS_BEFORE_WHEN_NULL = ("norm_weight_decay", "latency_threads")
COVERED_BY_LISTING = ("val_fraction", "split_seed", "limit")  # an image folder's listing digest holds their effect
UNUSED_BY_AUGMENT = {"none": ("crop_padding", "crop_scale"), "pad_crop": ("crop_scale",),  # data.augment -> keys
                     "random_resized_crop": ("crop_padding",)}  # it does not read


def result_hash(cfg, keys, images_followed):
    """A hash of the stage's config slice as far as it can change the stage's result: without data.cache_mb,
    data.cache_dir and data.download, without the keys that only judge the result (JUDGES_RESULT), without the crop
    keys data.augment does not read, without the keys of AS_BEFORE_WHEN_NULL left at null, data.root and
    data.unlabeled as the folders they name (a trailing slash, a relative path or a link to the same folder is the
    same folder), data.flip's default as it resolves, and - where the images' listing digest is an input
    (`images_followed`) - without the keys whose effect that digest already holds. Recorded beside `section_hash`:
    a completed stage whose config differs only in these is up to date."""
    blob = json.dumps(as_it_counts(config_slice(cfg, keys), images_followed), sort_keys=True, allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def as_it_counts(picked, images_followed):
    """A config slice (`config_slice`) as far as it can change a stage's result (see `result_hash`); a copy."""
    picked = copy.deepcopy(picked)
    for name in [k for k in picked if k.rsplit(".", 1)[-1] in AS_BEFORE_WHEN_NULL and picked[k] is None]:
        picked.pop(name)  # a dotted key a stage declares on its own ('export.latency_threads')
    for section in picked.values():
        if isinstance(section, dict):
            for key in AS_BEFORE_WHEN_NULL:
                if key in section and section[key] is None:
                    section.pop(key)
    for name, keys in JUDGES_RESULT.items():
        for key in keys:
            picked.pop(f"{name}.{key}", None)
            if isinstance(picked.get(name), dict):
                picked[name].pop(key, None)
    data = picked.get("data")
    if isinstance(data, dict):
        for key in NO_RESULT + (COVERED_BY_LISTING if images_followed and data.get("name") == "imagefolder" else ()):
            data.pop(key, None)
        for key in UNUSED_BY_AUGMENT.get(data.get("augment"), ()):  # crop_padding under random_resized_crop
            data.pop(key, None)
        for key in ("root", "unlabeled"):
            if data.get(key):
                data[key] = os.path.realpath(os.path.expanduser(data[key]))
        if data.get("flip") is None and "name" in data:
            data["flip"] = data["name"] in DATASETS and DATASETS[data["name"]].flip
    model = picked.get("model")
    for key in ("teacher_weights", "student_weights"):  # a file, however spelled, is the file (its sha256 an input)
        value = model.get(key) if isinstance(model, dict) else picked.get(f"model.{key}")
        if isinstance(value, str) and value and not _weights_name(value):
            if isinstance(model, dict):
                model[key] = os.path.abspath(os.path.expanduser(value))
            else:
                picked[f"model.{key}"] = os.path.abspath(os.path.expanduser(value))
    return picked


class FloatSource(NamedTuple):
    """Where the float model QAT quantizes and export ships comes from: an upstream stage's output, and which
    `model.*` key builds it."""

    stage: str
    output: str
    model_key: str  # "model.student" or "model.teacher"


QAT_SOURCES = {  # qat.source -> its float model
    "distill": FloatSource("distill", "model", "model.student"),
    "baseline": FloatSource("distill", "baseline", "model.student"),
    "teacher": FloatSource("teacher", "model", "model.teacher"),
}


def quantized_model(model_cfg, source):
    """The model name QAT quantizes and export ships (qat.source: the student for distill and baseline, else the
    teacher)."""
    return getattr(model_cfg, QAT_SOURCES[source].model_key.split(".")[1])


class UndeclaredConfigRead(AttributeError):
    """A stage read a config key outside its CONFIG_KEYS: a change to that key would not rerun the stage, so
    its outputs could go stale silently. A bug in the stage, never a user error."""


class ConfigView:
    """The config as one stage may see it: the keys in its CONFIG_KEYS (what decides whether it reruns) and the
    `train` section (how to run, never a reason to rerun). Reading anything else raises UndeclaredConfigRead.
    A section the stage declared whole comes back as the plain dataclass; a partly declared one as a view."""

    ALWAYS = ("train",)

    def __init__(self, cfg, keys, path=""):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_keys", tuple(keys))
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name):
        full = f"{self._path}.{name}" if self._path else name
        keys = tuple(k for k in self._keys if not k.startswith(LEFT_OUT)) + self.ALWAYS
        excluded = tuple(k[len(LEFT_OUT):] for k in self._keys if k.startswith(LEFT_OUT))
        whole = any(full == k or full.startswith(k + ".") for k in keys)
        if any(full == k or full.startswith(k + ".") for k in excluded) or not (
                whole or any(k.startswith(full + ".") for k in keys)):
            raise UndeclaredConfigRead(f"'{full}' is not among this stage's CONFIG_KEYS {list(self._keys)}; declare "
                                       "it (so a change to it reruns the stage) or stop reading it")
        value = getattr(self._cfg, name)
        partly = any(k.startswith(full + ".") for k in excluded)
        if dataclasses.is_dataclass(value) and (not whole or partly):
            return ConfigView(value, self._keys, full)
        return value

    def __setattr__(self, name, value):
        raise AttributeError("the config is read-only")

    def __repr__(self):
        return f"ConfigView({self._path or 'config'}, keys={list(self._keys)})"
