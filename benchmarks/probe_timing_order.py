"""Does a file's place in the latency table's timing order change its figure? A probe for BENCHMARKS.md.

The export stage times fp32, QAT int8 and PTQ int8 together, in turns. The QAT and PTQ int8 files of one run are
op-for-op identical after onnxruntime's fusions (12 QLinearConv, 4 QLinearAdd, ...), so any steady gap between
their figures is the protocol's. This reruns the export stage (`compress run --stages export --force`) of finished
runs with two versions of compress in turns - an older tree (`--old`, e.g. a `git worktree` of the commit before
the order changed) and this one - and records each file's cells and the verdict.

    git worktree add /tmp/oldtree <commit>
    python benchmarks/probe_timing_order.py --old /tmp/oldtree --runs /tmp/photos_r10_hinton/seed{0,1,2} \\
        --repeats 2 --json benchmarks/results/timing_order.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_once(tree, run):
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, "-m", "compress", "run", "--run-dir", run, "--stages", "export", "--force"],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"export of {run} with {tree} failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(run, "export", "export.json")) as f:
        export = json.load(f)
    cells = {kind: {f"b{c['batch']}t{c['threads']}": c["ms"] for c in got}
             for kind, got in export["latency_ms"].items()}
    return cells, export["verdict"]["file"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="a source tree of the older compress (its compress/ is imported)")
    p.add_argument("--runs", nargs="+", required=True, help="finished run directories (their export is rerun)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    trees = {"old": os.path.abspath(args.old), "new": HERE}
    rows = []
    for rep in range(args.repeats):
        for i, run in enumerate(args.runs):
            for code in (("old", "new") if (rep + i) % 2 == 0 else ("new", "old")):
                ms, deploy = export_once(trees[code], run)
                rows.append({"rep": rep, "run": run, "code": code, "deploy": deploy, "ms": ms})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| code | cell | QAT int8 / PTQ int8, each run | median | runs with QAT int8 slower |"
          "\n|---|---|---|---:|---:|")
    for code in ("old", "new"):
        for cell in ("b1t2", "b64t2"):
            ratios = [r["ms"]["int8"][cell] / r["ms"]["ptq"][cell] for r in rows if r["code"] == code]
            print(f"| {code} | {cell} | {', '.join(f'{v:.2f}' for v in ratios)} | {statistics.median(ratios):.2f} | "
                  f"{sum(v > 1 for v in ratios)} of {len(ratios)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/probe_timing_order.py " + " ".join(sys.argv[1:]), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
