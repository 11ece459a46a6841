"""Summarize a rerun of the qat and export stages on copies of finished photos runs, beside the original files.

The runs compared are made by hand (the commands go in the output as given):

    for s in 0 1 2; do cp -a /tmp/photos_r10_hinton/seed$s /tmp/stem/seed$s
        compress run --run-dir /tmp/stem/seed$s --stages qat,export --force; done
    for r in 1 2 3; do for s in 0 1 2; do compress bench /tmp/stem/seed$s/export/model.fp32.onnx \\
        /tmp/photos_r10_hinton/seed$s/export/model.int8.onnx /tmp/stem/seed$s/export/model.int8.onnx \\
        /tmp/stem/seed$s/export/model.ptq.onnx --json > /tmp/stem/bench_r${r}_s$s.json; done; done
    python benchmarks/summarize_qat_rerun.py --old /tmp/photos_r10_hinton --new /tmp/stem --seeds 0,1,2 \\
        --bench '/tmp/stem/bench_r*_s*.json' --out benchmarks/results/photos_float_stem.json

Each `compress bench` call times the four files interleaved in one session (fp32, the old int8, the new int8, the
new PTQ int8), so the old and new int8 files meet the same machine load; ratios are taken within a call.
"""

import argparse
import glob
import json
import os
import statistics

FILES = ("fp32", "old int8", "new int8", "new ptq")


def run_row(run):
    export = json.load(open(os.path.join(run, "export", "export.json")))
    manifest = json.load(open(os.path.join(run, "manifest.json")))["stages"]
    return {"float_layers": export.get("float_layers"), "fp32": round(export["fp32"]["onnx_acc"], 2),
            "int8": round(export["int8"]["onnx_acc"], 2), "ptq": round(export["ptq"]["onnx_acc"], 2),
            "deployed": export["verdict"]["file"],
            "qat_s": round(manifest["qat"]["seconds"], 1), "export_s": round(manifest["export"]["seconds"], 1)}


def mean_std(values):
    return [round(statistics.mean(values), 2), round(statistics.stdev(values), 2) if len(values) > 1 else 0.0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--bench", required=True, help="glob of `compress bench --json` outputs (the four files above)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {s: {"old": run_row(os.path.join(args.old, f"seed{s}")), "new": run_row(os.path.join(args.new, f"seed{s}"))}
            for s in seeds}
    accuracy = {f"{side} {kind}": mean_std([runs[s][side][kind] for s in seeds])
                for side in ("old", "new") for kind in ("int8", "ptq")}
    cells = {}
    for path in sorted(glob.glob(args.bench)):
        files = json.load(open(path))["files"]
        assert len(files) == len(FILES), path
        ms = {(i, c["batch"], c["threads"]): c["ms"] for i, f in enumerate(files) for c in f["cells"]}
        for batch, threads in sorted({k[1:] for k in ms}):
            got = [ms[(i, batch, threads)] for i in range(len(FILES))]
            cells.setdefault(f"batch {batch}, {threads} threads", []).append(got)
    latency = {}
    for key, calls in cells.items():
        cols = list(zip(*calls))
        ratio = lambda a, b: [x / y for x, y in zip(cols[a], cols[b])]  # noqa: E731
        summary = {"calls": len(calls), "median_ms": {f: round(statistics.median(c), 4) for f, c in zip(FILES, cols)}}
        for label, (a, b) in {"fp32 / old int8": (0, 1), "fp32 / new int8": (0, 2), "old int8 / new int8": (1, 2),
                              "fp32 / new ptq": (0, 3)}.items():
            r = ratio(a, b)
            summary[label] = {"median": round(statistics.median(r), 2), "min": round(min(r), 2),
                              "max": round(max(r), 2)}
        latency[key] = summary
    out = {"command": " ".join(["python", "benchmarks/summarize_qat_rerun.py", "--old", args.old, "--new", args.new,
                                "--seeds", args.seeds, "--bench", repr(args.bench), "--out", args.out]),
           "runs": runs, "accuracy_mean_std": accuracy, "latency": latency}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({"accuracy": accuracy, "latency": latency}, indent=1))


if __name__ == "__main__":
    main()
