"""A research probe, not the product: which teacher, logit loss, augmentation and schedule make distillation
keep paying on cifar10-dev? Everything on one GPU, data and augmentation resident on the device, many small
trainings at once (one process each), so a grid that would take a day on 2 CPU cores fits in minutes.

The recipe matches configs/cifar10.yaml: SGD Nesterov (teacher lr 0.1, student 0.05), weight decay 5e-4, batch
128, 1 warm-up epoch then cosine per step, pad-4 crop + flip. The losses are the product's
(compress/distill/logit_losses.py). A view k of image i is a fixed set of augmentation parameters (crop offset,
flip, and
with mixup/cutmix a partner image and its own crop, and lambda); epoch e shows view (e + offset_i) mod K, so
K >= epochs means a fresh view every epoch (the teacher runs on exactly the pixels the student sees, as with
the product's teacher-output store). Results are a probe to choose the product's recipe; the product's own
numbers come from benchmarks/bench_distill.py.

    python benchmarks/probe_kd_gpu.py --data ../shared/data/cifar10-dev --unlabeled ../shared/data/cifar10-unlabeled \
        --grid main --out /tmp/probe --parallel 12
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from compress.distill.logit_losses import logit_loss  # noqa: E402
from compress.models.architectures import CifarResNet, CompactCNN  # noqa: E402


def build(name, classes=10):
    if name == "compact_cnn":
        return CompactCNN(3, (32, 32), classes)
    n, width = {"resnet14": (2, 16), "resnet20": (3, 16), "resnet32": (5, 16), "resnet56": (9, 16),
                "resnet14x2": (2, 32), "resnet20x2": (3, 32)}[name]
    return CifarResNet(3, classes, n=n, width=width)


# ---------------------------------------------------------------- data


def load_folder(root, labelled=True):
    from PIL import Image

    images, labels, names = [], [], []
    if labelled:
        names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        for c, name in enumerate(names):
            for f in sorted(os.listdir(os.path.join(root, name))):
                images.append(np.asarray(Image.open(os.path.join(root, name, f)).convert("RGB")))
                labels.append(c)
    else:
        for folder, _, files in sorted(os.walk(root)):
            for f in sorted(files):
                images.append(np.asarray(Image.open(os.path.join(folder, f)).convert("RGB")))
                labels.append(-1)
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    return x, torch.tensor(labels, dtype=torch.long), names


def prepare_data(args):
    """uint8 tensors saved once as safetensors, so the worker processes need not decode JPEGs."""
    from safetensors.torch import save_file

    path = os.path.join(args.out, "data.safetensors")
    if not os.path.isfile(path):
        xt, yt, _ = load_folder(os.path.join(args.data, "train"))
        xv, yv, _ = load_folder(os.path.join(args.data, "val"))
        tensors = {"xt": xt, "yt": yt, "xv": xv, "yv": yv}
        if args.unlabeled:
            xu, yu, _ = load_folder(args.unlabeled, labelled=False)
            tensors.update(xu=xu, yu=yu)
        save_file(tensors, path)
    return path


# ---------------------------------------------------------------- views


class Views:
    """K fixed augmentation parameter sets per image (crop offsets, flip, mix partner, partner's crop, lambda)."""

    def __init__(self, n, k, mix, seed, alpha):
        r = np.random.default_rng(seed)
        self.k = k
        self.offset = torch.from_numpy(r.integers(0, k, n))
        self.dy, self.dx = (torch.from_numpy(r.integers(0, 9, (k, n))) for _ in range(2))
        self.flip = torch.from_numpy(r.random((k, n)) < 0.5)
        self.mix = mix
        if mix != "none":
            self.partner = torch.from_numpy(r.integers(0, n, (k, n)))
            self.pdy, self.pdx = (torch.from_numpy(r.integers(0, 9, (k, n))) for _ in range(2))
            self.pflip = torch.from_numpy(r.random((k, n)) < 0.5)
            lam = r.beta(alpha, alpha, (k, n)) if mix == "mixup" else r.random((k, n))
            self.lam = torch.from_numpy(lam.astype(np.float32))
            # cutmix boxes: area (1 - lam), centre uniform (clipped), as in Yun et al. 2019
            cut = np.sqrt(1.0 - lam)
            h = (cut * 32).astype(np.int64)
            cy, cx = r.integers(0, 32, (k, n)), r.integers(0, 32, (k, n))
            self.y0 = torch.from_numpy(np.clip(cy - h // 2, 0, 32))
            self.y1 = torch.from_numpy(np.clip(cy + h // 2, 0, 32))
            self.x0 = torch.from_numpy(np.clip(cx - h // 2, 0, 32))
            self.x1 = torch.from_numpy(np.clip(cx + h // 2, 0, 32))

    def to(self, device):
        for k, v in list(vars(self).items()):
            if torch.is_tensor(v):
                setattr(self, k, v.to(device))
        return self


def crop_flip(x, dy, dx, flip):
    """x uint8 (B, C, 32, 32) -> pad 4, crop at (dy, dx), maybe flip; float in [0, 1]."""
    b = x.shape[0]
    padded = F.pad(x.float(), (4, 4, 4, 4))
    rows = (dy[:, None] + torch.arange(32, device=x.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(32, device=x.device))[:, None, None, :]
    out = padded[torch.arange(b, device=x.device)[:, None, None, None],
                 torch.arange(3, device=x.device)[None, :, None, None], rows, cols]
    return torch.where(flip[:, None, None, None], out.flip(-1), out) / 255.0


def view_batch(images, views, idx, epoch):
    """(pixels in [0,1], partner index or None, weight of the image's own label)."""
    v = (epoch + views.offset[idx]) % views.k
    x = crop_flip(images[idx], views.dy[v, idx], views.dx[v, idx], views.flip[v, idx])
    if views.mix == "none":
        return x, None, None
    j = views.partner[v, idx]
    xp = crop_flip(images[j], views.pdy[v, idx], views.pdx[v, idx], views.pflip[v, idx])
    lam = views.lam[v, idx]
    if views.mix == "mixup":
        return lam[:, None, None, None] * x + (1 - lam[:, None, None, None]) * xp, j, lam
    y0, y1, x0, x1 = views.y0[v, idx], views.y1[v, idx], views.x0[v, idx], views.x1[v, idx]
    r = torch.arange(32, device=x.device)
    box = ((r[None, :, None] >= y0[:, None, None]) & (r[None, :, None] < y1[:, None, None])
           & (r[None, None, :] >= x0[:, None, None]) & (r[None, None, :] < x1[:, None, None]))
    out = torch.where(box[:, None], xp, x)
    own = 1.0 - box.float().mean((1, 2))
    return out, j, own


# ---------------------------------------------------------------- training


def lr_at(step, peak, total, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


@torch.no_grad()
def evaluate(model, x, y, mean, std):
    model.eval()
    correct = 0
    for i in range(0, len(x), 1000):
        logits = model(((x[i:i + 1000].float() / 255.0) - mean) / std)
        correct += (logits.argmax(1) == y[i:i + 1000]).sum().item()
    return 100.0 * correct / len(x)


def train(job, data, device, teacher=None):
    torch.manual_seed(job["seed"])
    model = build(job["model"]).to(device).to(memory_format=torch.channels_last)
    xt, yt = data["xt"], data["yt"]
    if job.get("unlabeled"):
        xt, yt = torch.cat([xt, data["xu"]]), torch.cat([yt, data["yu"]])
    mean, std = data["mean"], data["std"]
    n, epochs, batch = len(xt), job["epochs"], 128
    k = job.get("views") or epochs
    views = Views(n, k, job.get("mix", "none"), job.get("view_seed", 1000 + job["seed"]),
                  job.get("alpha", 1.0)).to(device)
    steps_per_epoch = -(-n // batch)
    total, warmup = epochs * steps_per_epoch, steps_per_epoch
    opt = torch.optim.SGD(model.parameters(), lr=job["lr"], momentum=0.9, nesterov=True, weight_decay=5e-4)
    method, ce_w, kd_w = job.get("method", "ce"), job.get("ce", 1.0), job.get("kd", 0.0)
    params = job.get("params", {})
    gen = torch.Generator(device="cpu")
    step = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        gen.manual_seed(job["seed"] * 100003 + epoch)
        order = torch.randperm(n, generator=gen).to(device)
        model.train()
        for b in range(steps_per_epoch):
            idx = order[b * batch:(b + 1) * batch]
            x, partner, own = view_batch(xt, views, idx, epoch)
            x = ((x - mean) / std).contiguous(memory_format=torch.channels_last)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, job["lr"], total, warmup)
            logits = model(x)
            y = yt[idx]
            labelled = (y >= 0).float()
            if partner is None:
                ce_each = F.cross_entropy(logits, y.clamp_min(0), reduction="none") * labelled
                mass = labelled
            else:
                yp = yt[partner]
                lp = (yp >= 0).float()
                ce_each = (own * labelled * F.cross_entropy(logits, y.clamp_min(0), reduction="none")
                           + (1 - own) * lp * F.cross_entropy(logits, yp.clamp_min(0), reduction="none"))
                mass = own * labelled + (1 - own) * lp
            loss = 0.0
            if ce_w:
                loss = loss + ce_w * ce_each.sum() / mass.sum().clamp_min(1e-6)
            if teacher is not None and kd_w:
                with torch.no_grad():
                    t = teacher(x).float()
                target = torch.where(y >= 0, y, t.argmax(1))
                if partner is not None:  # DKD's target on a mix: the dominant image's label (or teacher's pick)
                    yp = yt[partner]
                    target = torch.where(own >= 0.5, target, torch.where(yp >= 0, yp, t.argmax(1)))
                w = kd_w
                if method == "dkd":
                    w *= min((step + 1) / (params.get("warmup", 20) * steps_per_epoch), 1.0)
                loss = loss + w * logit_loss(method, logits.float(), t, target, job["T"], params)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    seconds = time.perf_counter() - start
    acc = evaluate(model, data["xv"], data["yv"], mean, std)
    return model, {"val_acc": acc, "seconds": round(seconds, 1), "images_per_s": round(epochs * n / seconds)}


def worker(payload):
    job, data_path, out_dir, device = payload
    torch.set_num_threads(1)
    torch.backends.cudnn.benchmark = True
    from safetensors.torch import load_file, save_file

    raw = load_file(data_path)
    data = {k: v.to(device) for k, v in raw.items()}
    xt = data["xt"].float() / 255.0
    data["mean"] = xt.mean((0, 2, 3)).view(1, 3, 1, 1)
    data["std"] = xt.std((0, 2, 3)).view(1, 3, 1, 1)
    teacher = None
    if job.get("teacher"):
        tj = job["teacher"]
        teacher = build(tj.split("@")[0]).to(device).to(memory_format=torch.channels_last)
        teacher.load_state_dict(load_file(os.path.join(out_dir, f"teacher-{tj}.safetensors"), device=str(device)))
        teacher.eval().requires_grad_(False)
    try:
        model, result = train(job, data, device, teacher)
    except Exception as e:  # a probe: record and go on
        return {**job, "error": f"{e.__class__.__name__}: {e}"}
    if job["kind"] == "teacher":
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  os.path.join(out_dir, f"teacher-{job['name']}.safetensors"))
    return {**job, **result}


# ---------------------------------------------------------------- grids


def teacher_jobs(grid):
    def t(model, epochs, mix="none"):
        return {"kind": "teacher", "name": f"{model}@{epochs}{'' if mix == 'none' else mix}", "model": model,
                "epochs": epochs, "lr": 0.1, "mix": mix, "seed": 0}

    if grid == "smoke":
        return [t("resnet14", 1)]
    return [t("resnet14", 30), t("resnet14", 120), t("resnet20", 120), t("resnet32", 120), t("resnet20", 120, "cutmix"),
            t("resnet14x2", 120), t("resnet20x2", 120)]


METHOD_DEFAULTS = {  # the papers' CIFAR settings
    "hinton": {"T": 4.0, "ce": 0.1, "kd": 0.9, "params": {}},
    "dkd": {"T": 4.0, "ce": 1.0, "kd": 1.0, "params": {"alpha": 1.0, "beta": 8.0, "warmup": 20}},
    "dist": {"T": 4.0, "ce": 1.0, "kd": 1.0, "params": {"beta": 1.0, "gamma": 1.0}},
    "standardized": {"T": 2.0, "ce": 0.1, "kd": 9.0, "params": {}},
}


def student_jobs(grid, best, wide=None, seeds=(0, 1, 2)):
    jobs = []

    def s(method, epochs, teacher=None, mix="none", priority=1, **kw):
        for seed in seeds:
            job = {"kind": "student", "model": "compact_cnn", "epochs": epochs, "lr": 0.05, "mix": mix, "seed": seed,
                   "method": method, "teacher": teacher, "priority": priority}
            if method != "ce":
                job.update(METHOD_DEFAULTS[method])
            job.update(kw)
            job["name"] = (f"{method}{'' if mix == 'none' else '+' + mix}@{epochs}"
                           f"{'' if not teacher else ' T=' + teacher}{' +unlab' if kw.get('unlabeled') else ''}"
                           f"{' ' + kw['tag'] if 'tag' in kw else ''}")
            jobs.append(job)

    if grid == "smoke":
        s("ce", 1)
        s("dkd", 1, teacher=best)
        s("standardized", 1, teacher=best, mix="mixup", unlabeled=True)
        return jobs
    if grid == "long":  # the second round: long schedules, mixing and unlabelled images with the chosen teacher
        s("standardized", 160, teacher=best, priority=0)
        s("dist", 160, teacher=best, priority=0)
        s("standardized", 80, teacher=best, unlabeled=True, priority=0)
        s("ce", 80, priority=0)
        s("standardized", 80, teacher=best, priority=0)
        s("ce", 160, mix="cutmix", priority=1)
        s("standardized", 160, teacher=best, mix="cutmix", priority=1)
        s("dist", 80, teacher=best, unlabeled=True, priority=1)
        s("dist", 80, teacher=best, priority=1)
        s("ce", 160, mix="mixup", priority=2)
        s("standardized", 160, teacher=best, mix="mixup", priority=2)
        s("standardized", 160, teacher=best, unlabeled=True, priority=2)
        return sorted(jobs, key=lambda j: j["priority"])
    orig = "resnet14@30"
    for epochs in (40, 160):  # priority 0: the main table
        s("ce", epochs, priority=0)
        for method in METHOD_DEFAULTS:
            s(method, epochs, teacher=best, priority=0)
    for mix in ("mixup", "cutmix"):
        s("ce", 160, mix=mix, priority=0)
        s("hinton", 160, teacher=best, mix=mix, priority=0, ce=0.0, kd=1.0, tag="FM")  # function matching: KD only
        s("standardized", 160, teacher=best, mix=mix, priority=0)
    s("hinton", 160, teacher=orig, priority=1)
    s("standardized", 160, teacher=orig, priority=1)
    s("hinton", 160, teacher=best, priority=1, views=8, tag="8views")
    s("standardized", 80, teacher=best, unlabeled=True, priority=1)
    s("standardized", 80, teacher=best, mix="cutmix", unlabeled=True, priority=1)
    s("hinton", 80, teacher=best, unlabeled=True, priority=1)
    if wide and wide != best:  # what a teacher too costly for the CPU would add
        s("hinton", 160, teacher=wide, priority=1)
        s("standardized", 160, teacher=wide, priority=1)
    for epochs in (80,):
        s("ce", epochs, priority=2)
        for method in METHOD_DEFAULTS:
            s(method, epochs, teacher=best, priority=2)
    return sorted(jobs, key=lambda j: j["priority"])


def run_jobs(jobs, data_path, out, device, parallel, deadline, results_path):
    import multiprocessing as mp

    results = []
    ctx = mp.get_context("spawn")
    with ctx.Pool(parallel, maxtasksperchild=1) as pool, open(results_path, "a") as f:
        pending = [pool.apply_async(worker, ((j, data_path, out, device),)) for j in jobs]
        for p in pending:
            left = deadline - time.time()
            if left <= 0:
                break
            try:
                r = p.get(timeout=left)
            except mp.TimeoutError:
                break
            results.append(r)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(json.dumps({k: r.get(k) for k in ("name", "seed", "val_acc", "seconds", "error")}), flush=True)
        pool.terminate()
    return results


def summary(results):
    by = {}
    for r in results:
        if "val_acc" in r:
            by.setdefault((r["kind"], r["name"]), []).append(r["val_acc"])
    lines = []
    for (kind, name), accs in sorted(by.items()):
        m = sum(accs) / len(accs)
        sd = (sum((a - m) ** 2 for a in accs) / (len(accs) - 1)) ** 0.5 if len(accs) > 1 else 0.0
        lines.append(f"{kind:8} {name:40} {m:6.2f} +- {sd:4.2f}  n={len(accs)}  {accs}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--unlabeled")
    p.add_argument("--out", required=True)
    p.add_argument("--grid", default="main")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--minutes", type=float, default=9.0, help="stop collecting results after this long")
    p.add_argument("--best-teacher", help="skip teacher training and use this one (must exist in --out)")
    p.add_argument("--results", help="results file (JSON lines; default: OUT/results.jsonl)")
    p.add_argument("--teachers-tar", help="after training the teachers, pack their weights into this tar file")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    deadline = start + args.minutes * 60
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results_path = args.results or os.path.join(args.out, "results.jsonl")
    data_path = prepare_data(args)
    print(f"data ready in {time.time() - start:.1f}s on {device}", flush=True)
    results = []
    best = args.best_teacher
    if not best:
        teachers = run_jobs(teacher_jobs(args.grid), data_path, args.out, device, args.parallel, deadline,
                            results_path)
        if args.teachers_tar:
            import tarfile

            with tarfile.open(args.teachers_tar, "w") as tar:
                for t in teachers:
                    name = f"teacher-{t['name']}.safetensors"
                    if os.path.isfile(os.path.join(args.out, name)):
                        tar.add(os.path.join(args.out, name), arcname=name)
        results += teachers
        ok = [t for t in teachers if "val_acc" in t]
        narrow = [t for t in ok if "x2" not in t["name"]]  # width 16: affordable on a 2-core CPU
        best = max(narrow, key=lambda t: t["val_acc"])["name"]
        wide = max(ok, key=lambda t: t["val_acc"])["name"]
        print(f"best teacher {best}, best of all {wide}", flush=True)
    else:
        wide = None
    results += run_jobs(student_jobs(args.grid, best, wide), data_path, args.out, device, args.parallel, deadline,
                        results_path)
    text = summary(results)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
