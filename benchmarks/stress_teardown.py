"""Stress test for a clean exit of multi-process runs: N short 2-process `compress run`s, each a fresh
torchrun group with no elastic restarts (`--max-restarts 0`: a restart must not hide a crash), while CPU
burners keep the machine busy. Counts non-zero exits and shows how each one ended.

    python benchmarks/stress_teardown.py --runs 30 --busy 2
    python benchmarks/stress_teardown.py --runs 10 --busy 0 --stages teacher,distill

Workers run with PYTHONFAULTHANDLER=1, so a worker that aborts (e.g. "terminate called without an active
exception") leaves the Python stack of every thread in the captured stderr.

Each worker also lists its OS threads at interpreter exit (tests/thread_census/sitecustomize.py, after every
other exit handler). A process group's gloo threads in that list (pt_gloo_runloop, gloo_tcp_loop) mean the
group outlived destroy_process_group() and was still running while Python finalized: the state the crash
needs. The script counts those runs too, so it measures the precondition even when the crash does not show
up (1 run in 7 on a loaded machine when first seen; 0 in 148 loaded runs of older code since, BENCHMARKS.md).
To measure another checkout (e.g. a git worktree of an older commit) with this script, run it from that
checkout's root, with it on PYTHONPATH:

    cd /tmp/before && PYTHONPATH=$PWD python /path/to/compress/benchmarks/stress_teardown.py --runs 30
"""

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CENSUS = os.path.join(ROOT, "tests", "thread_census")
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def burn(stop_at):
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) % 2**31


def _gloo_threads_at_exit(census):
    """{rank: number of gloo threads} for the workers that exited with some still running."""
    left = {}
    for name in sorted(os.listdir(census)):
        with open(os.path.join(census, name)) as f:
            count = sum(1 for line in f for thread in line.split() if thread in GLOO_THREADS)
        if count:
            left[name.removesuffix(".txt")] = count
    return left


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--busy", type=int, default=2, help="CPU-burning neighbour processes during the runs")
    parser.add_argument("--stages", default="teacher")
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "digits-quick.yaml"))
    parser.add_argument("--set", action="append", default=["teacher.epochs=1", "distill.epochs=1"],
                        help="config overrides (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args()

    exe = shutil.which("compress") or os.path.join(os.path.dirname(sys.executable), "compress")
    work = tempfile.mkdtemp(prefix="stress-teardown-")
    burners = [multiprocessing.Process(target=burn, args=(time.time() + 24 * 3600,), daemon=True)
               for _ in range(args.busy)]
    for b in burners:
        b.start()
    failures, times, lingering = [], [], []
    pythonpath = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), CENSUS) if p)
    try:
        for i in range(args.runs):
            cmd = [exe, "run", "-c", args.config, "--run-dir", os.path.join(work, f"run{i}"), "--stages", args.stages,
                   "--nproc-per-node", "2", "--max-restarts", "0", "--set", "train.progress=false"]
            cmd += [a for s in args.set for a in ("--set", s)]
            census = os.path.join(work, f"census{i}")
            os.makedirs(census)
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1",
                                       "PYTHONPATH": pythonpath, "THREAD_CENSUS_DIR": census})
            times.append(time.perf_counter() - start)
            status = "ok" if proc.returncode == 0 else f"EXIT {proc.returncode}"
            left = _gloo_threads_at_exit(census)
            if left:
                lingering.append(i)
            print(f"run {i + 1:3d}/{args.runs}: {status} ({times[-1]:.1f}s); gloo threads at exit: "
                  f"{left or 'none'}", flush=True)
            if proc.returncode != 0:
                failures.append((i, proc.returncode, proc.stderr))
                print("\n".join("    " + line for line in proc.stderr.splitlines()[-40:]), flush=True)
    finally:
        for b in burners:
            b.terminate()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.runs} runs of `compress run --nproc-per-node 2 --stages {args.stages}` with {args.busy} busy "
          f"neighbour process(es): {len(failures)} non-zero exit(s); {len(lingering)} run(s) whose workers finalized "
          f"with the process group's gloo threads still running; median run {sorted(times)[len(times) // 2]:.1f}s")
    for i, code, stderr in failures:
        marker = next((line for line in stderr.splitlines() if "terminate called" in line or "error" in line.lower()),
                      "")
        print(f"  run {i + 1}: exit {code}: {marker.strip()[:160]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
