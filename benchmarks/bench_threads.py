"""Training threads beside a busy neighbour: the tiny digits teacher (resnet14, 400 images, 1 epoch) with
train.threads = all usable CPUs against 1, alone and beside a neighbour process that keeps one core busy
(a 1-thread torch matmul loop), interleaved, --rounds rounds. Images/s from the stage's metrics.json.

    python benchmarks/bench_threads.py --work /tmp/threads --json benchmarks/results/threads.json
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

CONFIG = """\
seed: 0
data: {name: digits, augment: pad_crop, crop_padding: 1, limit: 400}
model: {teacher: resnet14, student: compact_cnn}
train: {progress: false}
teacher: {epochs: 1, batch_size: 32}
"""

NEIGHBOUR = ("import torch, time\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\n"
             "while True:\n    a = torch.tanh(a @ a)\n")


def teacher_rate(args, run, threads):
    shutil.rmtree(run, ignore_errors=True)
    cmd = [os.path.join(os.path.dirname(sys.executable), "compress"), "run", "-c", args.config_path, "--run-dir",
           run, "--stages", "teacher", "--set", f"train.threads={threads}"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    wall = time.perf_counter() - start
    with open(os.path.join(run, "teacher", "metrics.json")) as f:
        return json.load(f)["epochs"][0]["images_per_s"], wall


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    args.config_path = os.path.join(args.work, "tiny.yaml")
    with open(args.config_path, "w") as f:
        f.write(CONFIG)
    cpus = len(os.sched_getaffinity(0))
    out = {"command": "python benchmarks/bench_threads.py " + " ".join(sys.argv[1:]), "cpus": cpus, "rows": []}
    for r in range(args.rounds):
        for neighbour in (False, True):
            proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if neighbour else None
            try:
                time.sleep(1 if neighbour else 0)
                for threads in ((cpus, 1) if r % 2 == 0 else (1, cpus)):
                    rate, wall = teacher_rate(args, os.path.join(args.work, "run"), threads)
                    row = {"round": r, "neighbour": neighbour, "threads": threads, "images_per_s": rate,
                           "wall_s": round(wall, 1)}
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
            finally:
                if proc:
                    proc.kill()
                    proc.wait()
    print("\n| neighbour | threads | images/s (median of rounds) | stage wall s (median) |\n|---|---:|---:|---:|")
    for neighbour in (False, True):
        for threads in sorted({cpus, 1}, reverse=True):
            rows = [x for x in out["rows"] if x["neighbour"] == neighbour and x["threads"] == threads]
            print(f"| {'1 busy core' if neighbour else 'none'} | {threads} | "
                  f"{statistics.median(x['images_per_s'] for x in rows):,.0f} | "
                  f"{statistics.median(x['wall_s'] for x in rows):.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
