"""Wall time of the default `compress run` (all four stages on the embedded dataset), for several versions or
settings side by side: each variant in a fresh run directory, interleaved, --rounds rounds, median reported.

A variant is LABEL=SPEC, where SPEC is `installed` (the installed `compress`), or a folder holding another
version's `compress/` and `stages/` (e.g. from `git archive <commit>`), run with this interpreter; anything
after a `+` is passed as --set overrides (`installed+train.precision=fp32`).

    git archive fbbabcb | tar -x -C /tmp/before
    python benchmarks/bench_default_run.py --variant before=/tmp/before --variant after=installed \
        --variant after-fp32=installed+train.precision=fp32 --rounds 2 --work /tmp/default-run
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); from compress.cli import main; main(sys.argv[1:])"


def command(spec, run_dir):
    where, *overrides = spec.split("+")
    exe = ([os.path.join(os.path.dirname(sys.executable), "compress")] if where == "installed" else
           [sys.executable, "-c", BOOT, os.path.abspath(where)])
    sets = [a for o in overrides for a in ("--set", o)]
    return [*exe, "run", "--run-dir", run_dir, *sets]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, metavar="LABEL=SPEC")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", required=True)
    p.add_argument("--json")
    args = p.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    os.makedirs(args.work, exist_ok=True)
    times = {label: [] for label in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for label in order:
            run = os.path.join(args.work, f"{label}-{r}")
            shutil.rmtree(run, ignore_errors=True)
            cmd = command(variants[label], run)
            start = time.perf_counter()
            # from the work folder: an older version writes nothing outside its run directory either way
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=args.work,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            seconds = time.perf_counter() - start
            if proc.returncode:
                raise SystemExit(f"{label}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            times[label].append(round(seconds, 1))
            print(f"round {r + 1} {label}: {seconds:.1f} s", flush=True)
    print(f"\n| variant | wall s (median of {args.rounds}) | rounds |\n|---|---:|---|")
    for label, t in times.items():
        print(f"| {label} ({variants[label]}) | {statistics.median(t):.1f} | {', '.join(map(str, t))} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/bench_default_run.py " + " ".join(sys.argv[1:]),
                       "variants": variants, "seconds": times}, f, indent=2)


if __name__ == "__main__":
    main()
