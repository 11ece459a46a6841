"""The numeric precision and memory layout a model trains in: fp32, or autocast (bf16, or fp16 with a gradient
scaler), in channels-last or the default layout. A plain value the loop is given; `for_run` picks it from
train.precision and the hardware, and says why."""

import contextlib
import logging

import torch

from compress.errors import InputError

log = logging.getLogger(__name__)

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of x86 CPUs that compute bf16 natively


def cpu_bf16_support():
    """The CPU feature that makes bf16 autocast fast here ('avx512_bf16', 'amx_bf16'), or None. Read from the
    CPU's own flags and oneDNN's answer, never assumed: without native bf16, oneDNN emulates it and autocast
    is slower than fp32."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
    except (AttributeError, RuntimeError):
        return None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    return next((flag for flag in CPU_BF16_FLAGS if flag in flags), None)


def depthwise_convolutions(models):
    """How many depthwise convolutions (one filter group per input channel) the models hold."""
    return sum(1 for model in models for m in model.modules()
               if isinstance(m, torch.nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels)


def linear_share(models, example):
    """The share of the models' multiply-adds (convolutions and linear layers, one forward of `example` in eval
    mode) that linear layers do: about 0.93 for ConvNeXt's MLPs, at most 0.11 for MobileNets."""
    macs = {"linear": 0, "all": 0}

    def count(module, _, out):
        per_output = (module.in_features if isinstance(module, torch.nn.Linear) else
                      module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1])
        n = out.numel() // out.shape[0] * per_output
        macs["all"] += n
        macs["linear"] += n if isinstance(module, torch.nn.Linear) else 0

    modes = [m.training for m in models]
    hooks = [m.register_forward_hook(count) for model in models for m in model.modules()
             if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    try:
        with torch.no_grad():
            for model in models:
                device = next((p.device for p in model.parameters()), torch.device("cpu"))
                model.eval()(example.to(device))
    finally:
        for h in hooks:
            h.remove()
        for model, mode in zip(models, modes):
            model.train(mode)
    return macs["linear"] / macs["all"] if macs["all"] else 0.0


def cpu_auto(feature, models=(), example=None):
    """(choice, reason) of train.precision=auto on a CPU with the bf16 `feature` (None: none). bf16 only where it
    pays: on this CPU's AMX it trained dense convolutional models 1.7x faster than fp32 (and ConvNeXt, whose
    linear layers do most of its work, 1.5x), but convolutional models built on depthwise convolutions 1.3-2.1x
    slower (mobilenet_v2/v3, efficientnet_b0, mnasnet, shufflenet_v2; BENCHMARKS.md): those train in fp32."""
    if not feature:
        return "fp32", "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16), so fp32"
    depthwise = depthwise_convolutions(models)
    if depthwise and (example is None or linear_share(models, example) < 0.5):
        return "fp32", (f"auto: this CPU computes bf16 natively ({feature}), but bf16 trains convolutional models "
                        f"built on depthwise convolutions ({depthwise} here) slower than fp32 on a CPU, so fp32")
    return "bf16", f"auto: this CPU computes bf16 natively ({feature})"


class Precision:
    """fp32, or autocast (bf16, or fp16 with a gradient scaler), in a memory format: channels-last for the
    teacher and distill stages (`for_run`), the default layout for QAT and anything else (`FP32`)."""

    def __init__(self, dtype=None, device_type="cpu", memory_format=torch.contiguous_format, reason=""):
        self.dtype, self.device_type, self.memory_format, self.reason = dtype, device_type, memory_format, reason
        self.scaler = torch.amp.GradScaler(device_type) if dtype == torch.float16 else None

    @classmethod
    def for_run(cls, choice, device, models=(), example=None):
        """auto: bf16 on CUDA (fp16 + gradient scaling where bf16 is missing) and on a CPU that computes bf16
        natively unless `models` (the ones the stage trains or runs; `example`: one input batch) are convolutional
        models built on depthwise convolutions (`cpu_auto`), fp32 on other CPUs. Channels-last either way:
        convolutions train 1.15-2x faster in it on the CPU (BENCHMARKS.md), and tensor cores want it on CUDA."""
        reason = f"train.precision={choice}"
        if choice == "auto":
            if device.type == "cuda":
                choice = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
                reason = f"auto: CUDA {'with' if choice == 'bf16' else 'without'} bf16"
            else:
                choice, reason = cpu_auto(cpu_bf16_support(), models, example)
        if choice == "fp16" and device.type != "cuda":
            raise InputError("train.precision=fp16 needs a CUDA device; use auto, fp32 or bf16 on the CPU")
        return cls({"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[choice], device.type,
                   torch.channels_last, reason)

    @property
    def name(self):
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    @property
    def layout(self):
        return "channels_last" if self.memory_format == torch.channels_last else "contiguous"

    def describe(self):
        return {"precision": self.name, "memory_format": self.layout, "precision_reason": self.reason}

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
            return Precision(self.dtype, self.device_type, reason=self.reason)
        finally:
            for m, mode in zip(models, modes):
                m.train(mode)
        return self

    def inputs(self, x, device):
        return x.to(device, non_blocking=True, memory_format=self.memory_format) if x.dim() == 4 else x.to(device)

    def step(self, loss, optimizer, clip_grad_norm=None):
        """Backward and update; with `clip_grad_norm`, the gradients' global L2 norm is first scaled down to it (on
        the unscaled gradients under fp16: the limit is in the units of the loss). Under DDP the gradients are
        already averaged over the ranks here, so every rank clips alike."""
        if self.scaler is None:
            loss.backward()
            _clip(optimizer, clip_grad_norm)
            optimizer.step()
            return
        self.scaler.scale(loss).backward()
        if clip_grad_norm is not None:
            self.scaler.unscale_(optimizer)
            _clip(optimizer, clip_grad_norm)
        self.scaler.step(optimizer)
        self.scaler.update()


def _clip(optimizer, max_norm):
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], max_norm)


FP32 = Precision(reason="fp32 (always, for this step)")
