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


class Precision:
    """fp32, or autocast (bf16, or fp16 with a gradient scaler), in a memory format: channels-last for the
    teacher and distill stages (`for_run`), the default layout for QAT and anything else (`FP32`)."""

    def __init__(self, dtype=None, device_type="cpu", memory_format=torch.contiguous_format, reason=""):
        self.dtype, self.device_type, self.memory_format, self.reason = dtype, device_type, memory_format, reason
        self.scaler = torch.amp.GradScaler(device_type) if dtype == torch.float16 else None

    @classmethod
    def for_run(cls, choice, device):
        """auto: bf16 on CUDA (fp16 + gradient scaling where bf16 is missing) and on a CPU that computes bf16
        natively, fp32 on other CPUs. Channels-last either way: convolutions train 1.15-2x faster in it on the
        CPU (BENCHMARKS.md), and tensor cores want it on CUDA."""
        reason = f"train.precision={choice}"
        if choice == "auto":
            if device.type == "cuda":
                choice = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
                reason = f"auto: CUDA {'with' if choice == 'bf16' else 'without'} bf16"
            else:
                feature = cpu_bf16_support()
                choice = "bf16" if feature else "fp32"
                reason = (f"auto: this CPU computes bf16 natively ({feature})" if feature else
                          "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16), so fp32")
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

    def step(self, loss, optimizer):
        if self.scaler is None:
            loss.backward()
            optimizer.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)
        self.scaler.update()


FP32 = Precision(reason="fp32 (always, for this step)")
