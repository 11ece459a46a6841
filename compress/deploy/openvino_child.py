"""OpenVINO runs in a process of its own. Loaded into one process beside PyTorch and onnxruntime, their native
libraries corrupted memory on this project's machines (a segmentation fault minutes later, in unrelated Python
code), so compress never imports openvino itself: it starts `python -m compress.deploy.openvino_child`, sends a
JSON request on stdin and reads a JSON answer on stdout. The child imports numpy, onnx and openvino only.

    {"do": "table", "path": ..., "batch_sizes": [...], "threads": [...], "repeats": n, "warmup": n}
        -> [{"batch", "threads", "ms", "images_per_s"}, ...]
    {"do": "compare", "paths": {name: path}, "images": npy file, "threads": n, "rounds": n, "warmup": n}
        -> {name: {"min_ms", "median_ms", "runs"}}
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


def _input_shape(path):
    import onnx

    meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    if "compress.input_shape" in meta:
        return tuple(json.loads(meta["compress.input_shape"]))
    dims = onnx.load(path).graph.input[0].type.tensor_type.shape.dim[1:]
    return tuple(d.dim_value for d in dims)


def _session(path, threads):
    import openvino as ov

    core = ov.Core()
    config = {"PERFORMANCE_HINT": "LATENCY", **({"INFERENCE_NUM_THREADS": int(threads)} if threads else {})}
    compiled = core.compile_model(core.read_model(str(path)), "CPU", config)
    infer, output = compiled.create_infer_request(), compiled.output(0)
    return lambda batch: infer.infer({0: np.ascontiguousarray(batch, dtype=np.float32)})[output]


def _serve(req):
    from compress.deploy.timing import compare_latency, median_ms

    if req["do"] == "check":
        _session(req["path"], 1)
        return {"ok": True}
    if req["do"] == "table":
        shape, rows = _input_shape(req["path"]), []
        for t in req["threads"]:
            model = _session(req["path"], t)
            for b in req["batch_sizes"]:
                x = np.random.default_rng(0).standard_normal((b, *shape), dtype=np.float32)
                ms = median_ms(model, x, req["repeats"], req["warmup"])
                rows.append({"batch": b, "threads": t, "ms": round(ms, 4), "images_per_s": round(b * 1000.0 / ms, 1)})
        return rows
    x = np.load(req["images"], allow_pickle=False)
    models = {name: _session(path, req["threads"]) for name, path in req["paths"].items()}
    return compare_latency(models, x, rounds=req["rounds"], warmup=req.get("warmup", 2))


def main():
    try:
        print(json.dumps({"result": _serve(json.loads(sys.stdin.read()))}))
    except Exception as e:  # one line back to the parent, which turns it into a clear error
        print(json.dumps({"error": f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"}))
        sys.exit(1)


if __name__ == "__main__":
    main()
