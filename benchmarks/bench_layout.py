"""Memory layout: each model's training step and eval forward in the default (NCHW) layout against channels-last,
side by side in one process, interleaved rounds, median per image. This is why the teacher and distill stages
train in channels-last (`compress.training.precision.Precision.for_run`); QAT keeps the default layout.

    python benchmarks/bench_layout.py                 # the built-in models at the sizes the configs use
    python benchmarks/bench_layout.py --rounds 10
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from compress.models.registry import build_model  # noqa: E402

CASES = [("compact_cnn", (1, 28, 28), 64), ("resnet14", (1, 28, 28), 64),  # the default (mnist5k) pair
         ("compact_cnn", (3, 32, 32), 128), ("resnet14", (3, 32, 32), 128),  # configs/cifar10.yaml
         ("light_cnn", (3, 32, 32), 128), ("deep_cnn", (3, 32, 32), 128),  # configs/cifar10-tutorial.yaml
         ("mobilenet_v2", (3, 64, 64), 64), ("resnet18", (3, 64, 64), 64)]  # configs/imagefolder-resnet18.yaml


def timers(name, shape, batch, layout):
    torch.manual_seed(0)
    model = build_model(name, shape, 10).to(memory_format=layout)
    x = torch.randn(batch, *shape).contiguous(memory_format=layout)
    y = torch.randint(0, 10, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def train():
        model.train()
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    @torch.no_grad()
    def forward():
        model.eval()
        model(x)

    return {"train": train, "eval": forward}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=0.5, help="about how long each timing lasts")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    layouts = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} interleaved rounds\n")
    print("| model | input | batch | train step, ms/image: NCHW / channels-last | speed-up | "
          "eval forward: NCHW / channels-last | speed-up |\n|---|---|---:|---:|---:|---:|---:|")
    for name, shape, batch in CASES:
        fns = {k: timers(name, shape, batch, v) for k, v in layouts.items()}
        reps = {}
        for what in ("train", "eval"):  # repetitions for about --seconds per timing
            fns["nchw"][what]()
            start = time.perf_counter()
            fns["nchw"][what]()
            reps[what] = max(1, int(args.seconds / (time.perf_counter() - start)))
        times = {(k, w): [] for k in layouts for w in ("train", "eval")}
        for r in range(args.rounds):
            for k in (list(layouts) if r % 2 == 0 else list(layouts)[::-1]):
                for what, fn in fns[k].items():
                    fn()
                    start = time.perf_counter()
                    for _ in range(reps[what]):
                        fn()
                    times[(k, what)].append((time.perf_counter() - start) / reps[what] / batch * 1e3)
        med = {key: statistics.median(v) for key, v in times.items()}
        cells = []
        for what in ("train", "eval"):
            a, b = med[("nchw", what)], med[("channels_last", what)]
            cells.append(f"{a:.3f} / {b:.3f} | {a / b:.2f}x")
        print(f"| {name} | {'x'.join(map(str, shape))} | {batch} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
