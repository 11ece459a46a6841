"""The runtimes exported files are timed in: one registry, RUNTIMES (name -> Runtime), the only place a runtime
is named. The config's choices for export.runtimes, `compress bench --runtime`'s choices and help, and the report's
words for a runtime all derive from it; docs/extending.md ("Add a latency runtime") walks through adding one.

Every runtime times by the one protocol of compress.deploy.timing, so a figure means the same in each. Importing
this module loads no runtime (the config imports it and must stay importable without onnxruntime or openvino):
a runtime's package is imported when a file is first opened in it."""

import importlib.util
import os
import tempfile
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable

from compress.deploy.timing import Protocol, measure_cells
from compress.errors import CompressError, InputError

FIRST = "onnxruntime"  # always installed (a dependency), so always timed first: its figures decide the verdict


@dataclass(frozen=True)
class Runtime:
    """One latency runtime.

    label    its name in reports and help ("OpenVINO")
    package  the module that must be importable for it to run
    install  how a user installs it, said when it is missing
    opens    opens(path): load the file, raising InputError when the runtime cannot
    times    times(paths, x, batch_sizes, threads, protocol, stop) -> {name: [latency cell, ...]}: every file of
             {name: path} timed in each threads x batch-size cell on the inputs `x` (a batch of b is x[:b]),
             interleaved, by `protocol` (compress.deploy.timing.measure_cells is the reference)
    default  timed by default (export.runtimes: null) whenever installed
    """

    label: str
    package: str
    install: str
    opens: Callable
    times: Callable
    default: bool = True

    def available(self):
        return importlib.util.find_spec(self.package) is not None

    def check(self, path):
        """A clear error now for a missing runtime or a file it cannot load."""
        if not self.available():
            raise InputError(f"{self.label} is not installed; {self.install}")
        self.opens(path)

    def measure(self, paths, x, batch_sizes, threads, protocol=Protocol(), stop=None):
        return self.times(paths, x, list(batch_sizes), list(threads), protocol, stop)


def in_process(label, session, package, install, default=True):
    """A runtime driven from this process: `session(path, threads)` opens a file as a callable on a batch."""
    return Runtime(label, package, install, opens=partial(_opens, label, session),
                   times=partial(measure_cells, session), default=default)


def _opens(label, session, path):
    try:
        session(path, threads=1)
    except CompressError:
        raise
    except Exception as e:  # each runtime raises its own types: one sentence naming the file, whatever they are
        first = (str(e).splitlines() or [""])[0][:200]
        raise InputError(f"{label} cannot load '{path}' ({e.__class__.__name__}: {first}); pass an .onnx file "
                         "written by `compress run --stages export`") from None


def onnxruntime_session(path, threads=None):
    """The ONNX file at `path` in onnxruntime on the CPU, `threads` intra-op threads (a callable on a batch)."""
    from compress.deploy.onnx_model import OnnxModel

    return OnnxModel(path, threads=threads, require_metadata=False)


def _openvino_opens(path):
    from compress.deploy.openvino_child import request

    request({"do": "check", "path": str(path)})


def _openvino_times(paths, x, batch_sizes, threads, protocol, stop):
    """OpenVINO always runs in a child process of its own (compress.deploy.openvino_child says why), which runs
    compress.deploy.timing.measure_cells on the inputs it is sent."""
    import numpy as np

    from compress.deploy.openvino_child import request

    if stop:
        stop()
    with tempfile.TemporaryDirectory(prefix="compress-ov-") as tmp:
        inputs = os.path.join(tmp, "inputs.npy")
        np.save(inputs, np.ascontiguousarray(x[:max(batch_sizes)], dtype=np.float32), allow_pickle=False)
        return request({"do": "measure", "paths": {k: str(p) for k, p in paths.items()}, "inputs": inputs,
                        "batch_sizes": batch_sizes, "threads": threads, "protocol": asdict(protocol)})


RUNTIMES = {
    "onnxruntime": in_process("onnxruntime", onnxruntime_session, "onnxruntime", "pip install onnxruntime"),
    "openvino": Runtime("OpenVINO", "openvino", 'pip install -e ".[openvino]"',
                        opens=_openvino_opens, times=_openvino_times),
}


def installed(name):
    return name in RUNTIMES and RUNTIMES[name].available()


def default_runtimes():
    """onnxruntime, then every other default runtime that is installed (the first decides the verdict)."""
    return [FIRST] + [name for name, r in RUNTIMES.items() if name != FIRST and r.default and r.available()]


def missing(name):
    """Why runtime `name` cannot be used here, in words ('' when it can)."""
    if name not in RUNTIMES:
        return f"unknown runtime '{name}'; choose one of {', '.join(RUNTIMES)}"
    r = RUNTIMES[name]
    return "" if r.available() else f"{r.label} is not installed; {r.install}"


def label(name):
    """How reports name runtime `name` (a name no longer registered, from an older run: the name itself)."""
    return RUNTIMES[name].label if name in RUNTIMES else name


def config_help():
    """export.runtimes' help: what null means, with each optional runtime's install hint."""
    optional = [f"{r.label} when it is installed ({r.install})" for name, r in RUNTIMES.items()
                if name != FIRST and r.default]
    return (f"runtimes the files are timed in: null = {FIRST}" + "".join(f", plus {o}" for o in optional) +
            "; the first one decides which file to deploy")


def bench_help():
    """`compress bench --runtime`'s help: every runtime, and how to install the optional ones."""
    return "Runtime to time in: " + ", ".join(name if name == FIRST else f"{name} ({r.install})"
                                              for name, r in RUNTIMES.items()) + "."
