"""OpenVINO runs in a process of its own. Loaded into one process beside PyTorch and onnxruntime, their native
libraries corrupted memory on this project's machines (a segmentation fault minutes later, in unrelated Python
code), so compress never imports openvino itself: it starts `python -m compress.deploy.openvino_child`, sends a
JSON request on stdin and reads a JSON answer on stdout. The child imports numpy and openvino only.

    {"do": "measure", "paths": {name: path}, "inputs": npy file, "batch_sizes": [...], "threads": [...],
     "protocol": {...}}  -> {name: [latency cell, ...]}: compress.deploy.timing.measure_cells, as in onnxruntime
    {"do": "check", "path": ...}  -> {"ok": true} or {"error": "..."}
"""

import json
import os
import subprocess
import sys

import numpy as np

from compress.errors import InputError

# a helper process, not a member of the caller's process group: it does not inherit torchrun's variables
_DISTRIBUTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")


def request(payload, timeout=3600):
    """Run one request in a fresh child process and return its answer (an InputError for a refused file)."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED}
    proc = subprocess.run([sys.executable, "-m", "compress.deploy.openvino_child"], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=timeout, env=env)
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    except ValueError:
        answer = {}
    if proc.returncode or "error" in answer or "result" not in answer:
        reason = answer.get("error") or (proc.stderr.strip().splitlines() or ["no answer"])[-1]
        raise InputError(f"OpenVINO could not run {payload.get('path') or list(payload.get('paths', {}).values())} "
                         f"({reason[:200]})")
    return answer["result"]


def _session(path, threads):
    # `import openvino` imports its model converter, which sends a usage event to Google Analytics and writes a
    # client id under ~/intel unless a consent file there says no; with openvino_telemetry unimportable it uses
    # its own no-op stub (each import is guarded by `except ImportError`), so timing a file writes nothing outside
    # the run and sends nothing
    sys.modules.setdefault("openvino_telemetry", None)
    import openvino as ov

    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", **({"INFERENCE_NUM_THREADS": int(threads)} if threads else {})}
    compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
    infer, output = compiled.create_infer_request(), compiled.output(0)
    return lambda batch: infer.infer({0: np.ascontiguousarray(batch, dtype=np.float32)})[output]


def _serve(req):
    from compress.deploy.timing import Protocol, measure_cells

    if req["do"] == "check":
        _session(req["path"], 1)
        return {"ok": True}
    x = np.load(req["inputs"], allow_pickle=False)
    return measure_cells(_session, req["paths"], x, req["batch_sizes"], req["threads"], Protocol(**req["protocol"]))


def main():
    try:
        print(json.dumps({"result": _serve(json.loads(sys.stdin.read()))}))
    except Exception as e:  # one line back to the parent, which turns it into a clear error
        print(json.dumps({"error": f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"}))
        sys.exit(1)


if __name__ == "__main__":
    main()
