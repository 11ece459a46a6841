"""Do the export verdict, the report's latency table and `compress bench` give one figure per file? (Issue 45: the
same int8 file read 56.7 ms in the verdict, 83.2 ms in the table and 70.9 ms from bench, batch 64, one machine.)

On a finished default run - `compress run` in a temporary run directory, about a minute, or --run DIR - each of
--rounds interleaved rounds reruns the export stage (`compress run --stages export --force`: its verdict and its
table) and then `compress bench <run>`, and takes the batch-64, all-core figure of model.fp32.onnx and
model.int8.onnx from each: the verdict's (export.json's verdict.candidates), the table's (report.json's rows) and
bench's (`--json`). The load of the machine is taken before each round (os.getloadavg, and the cores other
processes kept busy, compress.cpus.busy_elsewhere): agreement is only expected on a quiet machine. With
--neighbours N, N processes spin on the CPU throughout (the busy case).

    python benchmarks/bench_latency_agreement.py --rounds 3 --json benchmarks/results/latency_agreement.json
"""

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from compress.cpus import busy_elsewhere, usable_cpus

FILES = ("model.fp32.onnx", "model.int8.onnx")
STATS = ("ms", "min_ms", "median_ms")  # the protocol's figure, the fastest call, the median of every call


def compress(*args):
    exe = shutil.which("compress") or os.path.join(os.path.dirname(sys.executable), "compress")
    done = subprocess.run([exe, *map(str, args)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"compress {' '.join(map(str, args))}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done.stdout


def figures(run):
    """{source: {file: ms}} at the verdict's cell, from one export and one bench; and the same batch on one
    thread (a cell the verdict does not read: table and bench only)."""
    compress("run", "--run-dir", run, "--stages", "export", "--force")
    with open(os.path.join(run, "export", "export.json")) as f:
        export = json.load(f)
    batch, threads = export["speed"]["batch"], export["speed"]["threads"]
    verdict = {c["file"]: c["ms"] for c in export["verdict"]["candidates"]}
    with open(os.path.join(run, "report.json")) as f:
        table = {r["file"].split("/")[-1]: r["latency_b64_ms"] for r in json.load(f)["rows"] if r.get("file")}
    timed = json.loads(compress("bench", run, "--json"))

    def at(cells, t):
        return next(c["ms"] for c in cells if (c["batch"], c["threads"]) == (batch, t))

    bench = {os.path.basename(f["path"]): at(f["cells"], threads) for f in timed["files"]}
    one = {"table": {name: at(export["latency_ms"][name.split(".")[1]], 1) for name in FILES},
           "bench": {os.path.basename(f["path"]): at(f["cells"], 1) for f in timed["files"]}}
    def stats(cells, t):
        c = next(c for c in cells if (c["batch"], c["threads"]) == (batch, t))
        return {stat: c[stat] for stat in STATS}

    by_stat = {t: {"table": {name: stats(export["latency_ms"][name.split(".")[1]], t) for name in FILES},
                   "bench": {os.path.basename(f["path"]): stats(f["cells"], t) for f in timed["files"]}}
               for t in sorted({1, threads})}
    return {"batch": batch, "threads": threads, "by_stat": {str(t): v for t, v in by_stat.items()},
            "ms": {source: {name: got[name] for name in FILES} for source, got in
                   (("verdict", verdict), ("table", table), ("bench", bench))},
            "one_thread_ms": {source: {name: got[name] for name in FILES} for source, got in one.items()}}


def spin(until):
    while time.time() < until:
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run", help="a finished default run directory to use (its export is rerun); default: a new one")
    p.add_argument("--neighbours", type=int, default=0, help="processes spinning on the CPU throughout")
    p.add_argument("--json")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="latency-agreement-")
    run = args.run or os.path.join(work, "run")
    start = time.perf_counter()
    if not args.run:
        compress("run", "--run-dir", run)
    out = {"command": "python benchmarks/bench_latency_agreement.py " + " ".join(sys.argv[1:]), "run": run,
           "usable_cpus": usable_cpus(), "neighbours": args.neighbours, "rounds": []}
    neighbours = [multiprocessing.Process(target=spin, args=(time.time() + 3600,), daemon=True)
                  for _ in range(args.neighbours)]
    for n in neighbours:
        n.start()
    try:
        for r in range(args.rounds):
            load = {"loadavg_1min": round(os.getloadavg()[0], 2), "cpus_busy": round(busy_elsewhere(1.0) or 0.0, 2)}
            got = figures(run)
            out["rounds"].append({"round": r + 1, **load, **got})
            print(json.dumps(out["rounds"][-1]), flush=True)
    finally:
        for n in neighbours:
            n.terminate()
    out["seconds"] = round(time.perf_counter() - start, 1)
    report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if not args.run:
        shutil.rmtree(work, ignore_errors=True)


def report(out):
    first = out["rounds"][0]
    print(f"\nbatch {first['batch']}, {first['threads']} threads, onnxruntime; ms of a call (the median over 5 "
          f"interleaved rounds of each round's fastest call); {out['usable_cpus']} usable CPUs, "
          f"{out['neighbours']} spinning neighbours\n")
    print("| round | load (1 min) | CPUs busy elsewhere | file | verdict ms | table ms | bench ms | spread |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|")
    spreads = {name: [] for name in FILES}
    for r in out["rounds"]:
        for name in FILES:
            ms = [r["ms"][source][name] for source in ("verdict", "table", "bench")]
            spread = (max(ms) - min(ms)) / min(ms)
            spreads[name].append(spread)
            print(f"| {r['round']} | {r['loadavg_1min']:.2f} | {r['cpus_busy']:.2f} | {name} | {ms[0]:.3f} | "
                  f"{ms[1]:.3f} | {ms[2]:.3f} | {spread:.1%} |")
    for name in FILES:
        every = [r["ms"][s][name] for r in out["rounds"] for s in ("verdict", "table", "bench")]
        print(f"\n{name}: largest spread within a round {max(spreads[name]):.1%}; over all rounds and sources "
              f"{min(every):.3f}-{max(every):.3f} ms (median {statistics.median(every):.3f})")
    out["largest_spread"] = {name: round(max(v), 4) for name, v in spreads.items()}
    print("\nTable vs bench within 10 %, by statistic (pairs of one file, one round):\n")
    print("| threads | statistic | pairs within 10 % | largest gap |")
    print("|---:|---|---:|---:|")
    for t in out["rounds"][0]["by_stat"]:
        for stat in STATS:
            gaps = []
            for r in out["rounds"]:
                for name in FILES:
                    a, b = r["by_stat"][t]["table"][name][stat], r["by_stat"][t]["bench"][name][stat]
                    gaps.append((max(a, b) - min(a, b)) / min(a, b))
            print(f"| {t} | {stat} | {sum(g <= 0.10 for g in gaps)} of {len(gaps)} | {max(gaps):.0%} |")
    print("\nThe same batch on 1 thread (a cell the verdict does not read): table and bench\n")
    print("| round | file | table ms | bench ms | spread |")
    print("|---:|---|---:|---:|---:|")
    for r in out["rounds"]:
        for name in FILES:
            table, bench = r["one_thread_ms"]["table"][name], r["one_thread_ms"]["bench"][name]
            print(f"| {r['round']} | {name} | {table:.3f} | {bench:.3f} | "
                  f"{(max(table, bench) - min(table, bench)) / min(table, bench):.1%} |")


if __name__ == "__main__":
    main()
