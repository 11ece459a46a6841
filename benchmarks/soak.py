"""Soak test: kill -9 the pipeline at random wall-clock moments, rerun it, and check that the final weights and
ONNX files are byte-identical to an uninterrupted run.

Each round starts `compress run` on a run directory that carries the previous round's partial state, sleeps a
random time, sends SIGKILL (anywhere: training, evaluation, building the distill stage's on-disk teacher-output
store, a checkpoint write, export), then the next round continues on the same directory. After the kills, one
final run completes the pipeline, and the outputs are compared with a reference run. Repeat `--trials` times.
The in-memory teacher view cache it used to kill is gone (the distill stage now builds an on-disk store), and the
export stage's model.ptq.onnx is compared too when the reference run wrote one.

    python benchmarks/soak.py --kills 20                      # configs/digits-quick.yaml, ~5 minutes
    python benchmarks/soak.py --kills 20 --set teacher.epochs=8 --set distill.epochs=8 --set qat.epochs=4 \
        --set train.checkpoint_every=10                       # longer training: more kills land mid-epoch
    python benchmarks/soak.py --config configs/default.yaml --kills 20
"""

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARED = ("teacher/model.safetensors", "distill/model.safetensors", "qat/qat.safetensors",
            "export/model.fp32.onnx", "export/model.int8.onnx", "export/model.ptq.onnx")


def compress(args):
    exe = os.path.join(os.path.dirname(sys.executable), "compress")
    return subprocess.Popen([exe, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def finish(args):
    proc = compress(args)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{err[-3000:]}")
    return err


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "digits-quick.yaml"))
    parser.add_argument("--kills", type=int, default=20, help="random SIGKILLs in all")
    parser.add_argument("--kills-per-trial", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None, help="seed for the kill times (default: random)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        reference = os.path.join(tmp, "reference")
        start = time.perf_counter()
        base = ["-c", args.config, *[a for kv in args.set for a in ("--set", kv)]]
        finish(["run", *base, "--run-dir", reference])
        duration = time.perf_counter() - start
        compared = [rel for rel in COMPARED if os.path.isfile(os.path.join(reference, rel))]  # ptq: export.ptq
        print(f"reference run: {duration:.1f}s; kill seed {seed}", flush=True)
        trials, identical, kills, resumed = 0, 0, 0, 0
        while kills < args.kills:
            trials += 1
            run = os.path.join(tmp, f"trial{trials}")
            events = []  # (delay, what the killed run was doing) per kill
            logs = []
            for _ in range(min(args.kills_per_trial, args.kills - kills)):
                proc = compress(["run", *base, "--run-dir", run])
                delay = rng.uniform(0.5, duration)
                try:
                    _, err = proc.communicate(timeout=delay)
                    logs.append(err)
                    events.append(None)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
                    _, err = proc.communicate()
                    logs.append(err)
                    events.append((delay, doing(err)))
                    kills += 1
            logs.append(finish(["run", *base, "--run-dir", run]))
            notes = []
            for i, event in enumerate(events):
                if event is None:
                    continue
                found = RESUME.search(logs[i + 1])
                resumed += found is not None
                after = "resumed " + found.group(1) if found else "nothing to resume"
                notes.append(f"{event[0]:.1f}s into a run, during {event[1]} -> {after}")
            same = [rel for rel in compared if read(os.path.join(reference, rel)) == read(os.path.join(run, rel))]
            ok = len(same) == len(compared)
            identical += ok
            verdict = "identical" if ok else "DIFFERENT: " + ", ".join(sorted(set(compared) - set(same)))
            print(f"trial {trials}: {'; '.join(notes) or 'no kill landed'}; {verdict}", flush=True)
            shutil.rmtree(run)
        print(f"\n{kills} kills in {trials} trials ({resumed} continued from a resume checkpoint or a part-built "
              f"store): {identical} of {trials} trials ended byte-identical to the uninterrupted run")
        sys.exit(0 if identical == trials else 1)


STAGE_LINE = re.compile(r"^\S+ (teacher|distill|qat|export): (.*)$")
# a stage's resume checkpoint, or the distill stage's teacher-output store, whose build continues where it stopped
RESUME = re.compile(r"(\w+: resuming the interrupted run [^\n]*|distill: teacher outputs: resuming the build [^\n]*)")


def doing(stderr):
    """What a killed run was doing, from its last stage log line."""
    lines = [m.groups() for m in map(STAGE_LINE.match, stderr.splitlines()) if m]
    if not lines:
        return "start-up (imports, data)"
    stage, text = lines[-1]
    if text.startswith("epoch"):
        return f"{stage} training after {text.split(' train_loss')[0]}"
    if text.startswith("done"):
        return f"the step after {stage}"
    return f"{stage} ({text[:40]})"


if __name__ == "__main__":
    main()
