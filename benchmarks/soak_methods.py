"""kill -9 during the distill stage, with each logit loss and with unlabelled images, then rerun: the final
student must be bit-identical to the run that was never killed (the suite checks one method; this checks all).

For each method: an uninterrupted distill stage, then one killed with SIGKILL at a random step of a random
epoch (tests/faults.py), rerun to completion, and the two students' tensors compared. Digits (8x8) and 200
generated unlabelled images keep it to seconds per run; --data-root runs it on an image folder instead.

    python benchmarks/soak_methods.py --seed 1
    python benchmarks/soak_methods.py --seed 2 --set distill.mix=mixup --set distill.ce_weight=0   # function matching
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTS = os.path.join(ROOT, "tests", "faults.py")
METHODS = ("hinton", "dkd", "dist", "standardized")


def run(args, run_dir, overrides, fault=None):
    cmd = [sys.executable, FAULTS, "run", "--run-dir", run_dir, "--stages", "teacher,distill",
           "--set", "train.progress=false", *[a for o in overrides for a in ("--set", o)]]
    env = {**os.environ, **({"COMPRESS_FAULT": fault} if fault else {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def weights(run_dir):
    from compress.training.checkpoint import read_weights

    return read_weights(os.path.join(run_dir, "distill", "model.safetensors"))[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more config overrides for every run, e.g. distill.mix=mixup")
    args = p.parse_args()
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        unlabeled = os.path.join(tmp, "unlabeled")
        os.makedirs(unlabeled)
        pixels = np.random.default_rng(args.seed).integers(0, 255, (200, 8, 8), dtype=np.uint8)
        for i, image in enumerate(pixels):
            Image.fromarray(image).save(os.path.join(unlabeled, f"{i}.png"))
        common = ["data.name=digits", "data.augment=pad_crop", "data.crop_padding=1", "teacher.epochs=2",
                  "teacher.batch_size=32", f"distill.epochs={args.epochs}", "distill.batch_size=32",
                  "distill.baseline=false", f"data.unlabeled={unlabeled}", "train.checkpoint_every=7", *args.set]
        steps = -(-(1617 + 200) // 32)
        for method in METHODS:
            settings = [*common, f"distill.kd.method={method}"]
            straight, killed = os.path.join(tmp, f"{method}-straight"), os.path.join(tmp, f"{method}-killed")
            assert run(args, straight, settings).returncode == 0
            epoch, step = rng.randrange(args.epochs), rng.randrange(steps - 1)
            proc = run(args, killed, settings, fault=f"distill:{epoch}:{step}:kill")
            assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
            again = run(args, killed, settings)
            assert again.returncode == 0, again.stderr[-2000:]
            a, b = weights(straight), weights(killed)
            identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            resumed = "distill: resuming" in again.stderr
            results.append({"method": method, "killed_at": f"epoch {epoch + 1}, step {step + 1}",
                            "resumed_from_checkpoint": resumed, "bit_identical": identical})
            print(json.dumps(results[-1]), flush=True)
            shutil.rmtree(straight)
            shutil.rmtree(killed)
    print(f"\n{sum(r['bit_identical'] for r in results)} of {len(results)} methods bit-identical after kill -9 "
          f"(seed {args.seed}{', ' + ' '.join(args.set) if args.set else ''})")
    sys.exit(0 if all(r["bit_identical"] for r in results) else 1)


if __name__ == "__main__":
    main()
