"""What a user does first with the file they will deploy: classify a folder of images, and measure accuracy on a
labelled image-folder tree (top-1, top-5, per class, confusion matrix) - with the file's own preprocessing,
numpy and onnxruntime only."""

import glob
import os
import shlex
import unicodedata

import numpy as np

from compress.deploy import export_report
from compress.deploy.folders import class_folders, loose_images, skipped, split_folders, split_name
from compress.deploy.imageio import IMAGE_EXTENSIONS, printable
from compress.deploy.onnx_model import fixed_batch_error
from compress.errors import InputError
from compress.fileio import one_line, walk_tree


def run_of(path):
    """The run directory `path` names: itself, or its parent when `path` is the run's export/ folder."""
    if os.path.basename(os.path.normpath(path)) == "export" and os.path.isfile(os.path.join(path, "export.json")):
        return os.path.dirname(os.path.normpath(path)) or "."
    return path


RUNS_FOLDER = "artifacts"  # where `compress run` puts a run it is not given a --run-dir for


def runs_here():
    """The run directories under ./artifacts/ (folders holding a manifest.json), the most recently run first."""
    try:
        folders = [e.path for e in os.scandir(RUNS_FOLDER) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    runs = []
    for folder in folders:
        try:
            runs.append((-os.stat(os.path.join(folder, "manifest.json")).st_mtime, folder))
        except OSError:  # no manifest: not a run
            continue
    return [folder for _, folder in sorted(runs)]


def run_hint(path):
    """'; did you mean artifacts/<path>?' when `path` is not a run but names one under ./artifacts/ (a run started
    with -c photos or --name photos lives in artifacts/photos), else ''."""
    candidate = os.path.join(RUNS_FOLDER, str(path))
    if os.sep not in str(path).rstrip(os.sep) and os.path.isfile(os.path.join(candidate, "manifest.json")):
        return f"; did you mean {candidate}?"
    return ""


def run_files(path):
    """(run directory, {kind: path}) of a run directory or its export/ folder: the files its export verdict
    weighed - fp32 first, then the int8 files - each strictly inside the run's export/ folder; one clear error
    for a folder without an export."""
    run = _export_run(path)
    report = export_report.read(run)
    if report.verdict.candidates:
        named = {c.kind: (c.file, f"verdict.candidates[{i}].file") for i, c in enumerate(report.verdict.candidates)}
    else:  # an export from before the verdict weighed every file: the pair it weighed
        named = {"fp32": (report.files.get("fp32", "model.fp32.onnx"), "files.fp32"),
                 "int8": (report.speed.int8_file, "speed.int8_file")}
    return run, {k: export_report.deployment_file(run, name, key) for k, (name, key) in named.items()}


def deployed_file(path):
    """(ONNX file, note): `path` itself, or for a run directory (or its export/ folder) the file its export
    stage recommends - strictly inside the run's export/ folder."""
    if not os.path.exists(path) and not str(path).lower().endswith(".onnx"):  # an .onnx file: "ONNX file not found"
        usage = "; pass an .onnx file, or a run directory whose export stage ran"
        raise InputError(f"'{path}' does not exist{run_hint(path) or usage}")
    if not os.path.isdir(path):
        return path, ""
    run = _export_run(path)
    verdict = export_report.read(run, "verdict")
    file = export_report.deployment_file(run, verdict.file, "verdict.file")
    return file, f"{verdict.file}, export's choice (compress show {one_line(shlex.quote(str(run)))} says why)"


def _export_run(path):
    run = run_of(path)
    if not os.path.isfile(export_report.report_path(run)):
        finish = (f"finish this run first (compress run --run-dir {shlex.quote(str(run))})"
                  if os.path.isfile(os.path.join(run, "manifest.json")) else "a run directory whose export stage ran")
        raise InputError(f"'{path}' is a folder without export/export.json; pass an .onnx file, or {finish}")
    return run


def image_paths(arguments, others=None):
    """Image files from files, folders (every image below, sorted) and glob patterns, in the order given. A
    pattern's matches are read as a folder's files are: a folder walked, a file that is no image by its name left
    out, each image once. The files a folder holds that are not images compress reads are counted by suffix into
    `others` (a Counter) when given."""
    found = []
    for arg in arguments:
        arg = os.path.expanduser(arg)
        if any(c in arg for c in "*?[") and not os.path.exists(arg):
            matches = _glob(arg)
            if not matches:
                raise InputError(f"no file matches '{arg}'")
            found.extend(dict.fromkeys(p for m in matches if os.path.isdir(m) or m.lower().endswith(IMAGE_EXTENSIONS)
                                       for p in _images_in(m)))  # 'photos/**' matches photos/ and each folder below
        else:
            found.extend(_images_in(arg, others))
    return found


def _glob(pattern):
    """glob.glob(pattern, recursive=True), sorted, with each `**` walked once by `walk_tree`: glob follows links to
    folders under `**` without end (two links to `.` make a walk that never finishes, one names each image 40
    times)."""
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return sorted(glob.glob(pattern))
    i = parts.index("**")
    base, rest = os.sep.join(parts[:i]) or ("." if i == 0 else os.sep), os.sep.join(parts[i + 1:])
    bases = glob.glob(base) if glob.has_magic(base) else [base]
    matches = set()
    for top in (b for b in bases if os.path.isdir(b)):
        if not rest:  # 'photos/**': the folder, walked by the caller (each image once)
            matches.add(top)
            continue
        for folder, _ in walk_tree(top, skip=skipped):
            matches.update(_glob(os.path.join(glob.escape(folder), rest)))
    return sorted(matches)


def _images_in(arg, others=None):
    """The images a folder holds (one bounded walk: a link loop inside it is read once), or [arg] for a file."""
    if not os.path.isdir(arg):
        return [arg]
    images = []
    for folder, files in walk_tree(arg, skip=skipped):
        for f in files:
            if f.lower().endswith(IMAGE_EXTENSIONS):
                images.append(os.path.join(folder, f))
            elif others is not None:
                others[os.path.splitext(f)[1].lower() or f] += 1
    return images


def predict_files(model, paths, top_k=3, chunk=64):
    """Yield (path, [(class, probability)...] or None, error or None) for each image; an unreadable one is
    reported and skipped, the others still classified."""
    names = model.class_names()
    _check_batches(model)
    for start in range(0, len(paths), chunk):
        batch, errors = [], {}
        for path in paths[start:start + chunk]:
            try:
                batch.append(model.preprocess([path])[0])
            except InputError as e:
                errors[path] = str(e)
        read = [path for path in paths[start:start + chunk] if path not in errors]
        probs = iter(_softmax(_finite(model, model.scores(np.stack(batch)), read)) if batch else [])
        for path in paths[start:start + chunk]:  # in the order given, unreadable ones in their place
            if path in errors:
                yield path, None, errors[path]
                continue
            p = next(probs)
            order = np.argsort(-p, kind="stable")[:top_k]  # ties: the lower class index first, as argmax (eval)
            yield path, [(names[i], float(p[i])) for i in order], None


def labelled_tree(root, class_names):
    """[(path, class index)] of an image-folder tree root/<class>/<image> (or its val/ or test/ split when root
    holds train/ too), checked against the model's classes."""
    root = os.path.expanduser(root)
    if not os.path.isdir(root):
        raise InputError(f"'{root}' is not a folder; pass a folder of class folders (<class>/<image>)")
    train, held_out = split_folders(root)
    if train and held_out:
        root = os.path.join(root, held_out)
    classes = class_folders(root)
    if not classes:
        raise InputError(f"'{root}' holds no class folders; eval needs <class>/<image> folders named like the "
                         f"model's classes ({_some(class_names, 5)})")
    known = {unicodedata.normalize("NFC", c): i for i, c in enumerate(class_names)}  # café copied from macOS
    unknown = [c for c in classes if unicodedata.normalize("NFC", c) not in known]
    if unknown:
        splits = [c for c in unknown if split_name(c)]
        hint = (f"; if '{os.path.join(root, splits[0])}' holds the class folders, pass that" if splits
                and len(unknown) == len(classes) else "")
        raise InputError(f"'{root}' has class folder(s) the model does not know: {_some(unknown, 5)}; the model's "
                         f"classes are {_some(class_names, 10)}{hint}")
    samples = [(p, known[unicodedata.normalize("NFC", c)]) for c in classes
               for p in _images_in(os.path.join(root, c))]
    if not samples:
        raise InputError(f"'{root}' holds no images in its class folders")
    return root, samples


def unread_note(root, samples, class_names):
    """A note on what a labelled tree holds that is not evaluated, or '': images beside the class folders (in no
    class), files in the class folders that are not images compress reads (.gif, .heic, notes), by suffix, and
    class folders left without any image by them."""
    from collections import Counter

    notes = []
    loose = loose_images(root)
    if loose:
        notes.append(f"{loose:,} image(s) directly in '{printable(root)}' are in no class folder and are not "
                     "evaluated; move them into their class's folder")
    others = Counter()
    for c in class_folders(root):
        for _, files in walk_tree(os.path.join(root, c), skip=skipped):
            others.update(os.path.splitext(f)[1].lower() or f for f in files
                          if not f.lower().endswith(IMAGE_EXTENSIONS) and not skipped(f))
    if others:
        present = {label for _, label in samples}
        known = {unicodedata.normalize("NFC", c): i for i, c in enumerate(class_names)}
        empty = [c for c in class_folders(root) if known.get(unicodedata.normalize("NFC", c)) not in present]
        kinds = ", ".join(f"{n:,} {suffix}" for suffix, n in others.most_common(5))
        notes.append(f"skipped {sum(others.values()):,} file(s) in the class folders that are not images compress "
                     f"reads ({kinds}); convert them to one of {', '.join(IMAGE_EXTENSIONS)} to evaluate them"
                     + (f" - class folder(s) {_some(empty, 5)} hold no other image, so their accuracy is not "
                        "measured" if empty else ""))
    return "; ".join(notes)


def _some(names, most):
    """Up to `most` names, each on one line (names come from folders and from model files), and how many more:
    'a, b, c and 7 more'."""
    shown = ", ".join(one_line(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_png_path(path):
    """A clear error now, not after a whole evaluation, for a --png file that cannot be written."""
    if not path.lower().endswith(".png"):
        raise InputError(f"--png '{path}': the confusion matrix is drawn as PNG; give a file name ending in .png")
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    if not os.path.isdir(folder):
        raise InputError(f"--png '{path}': the folder '{folder}' does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK):
        raise InputError(f"--png '{path}': the folder '{folder}' is not writable; choose another path")
    target = os.path.join(folder, os.path.basename(path))
    run = _run_holding(os.path.dirname(os.path.realpath(target)))  # through links: where the drawing would land
    if run and os.path.lexists(target):
        raise InputError(f"--png '{path}' is a file of the run directory '{run}', which eval would overwrite; "
                         "choose a new file name")


def _run_holding(folder):
    """The compress run directory `folder` is in (or is), else None: its files are the pipeline's record."""
    from compress.run.rundir import RunDir

    while True:
        if RunDir(folder).exists():
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def evaluate_tree(model, samples, chunk=256):
    """Accuracy figures of `model` on [(path, label)]: top-1, top-5 (None with 5 classes or fewer), per class,
    the confusion matrix (rows: true class, columns: predicted) and the files that could not be read."""
    n = len(model.class_names())
    confusion = np.zeros((n, n), dtype=np.int64)
    top5 = count = 0
    skipped = []
    _check_batches(model)
    for start in range(0, len(samples), chunk):
        batch, labels = [], []
        for path, label in samples[start:start + chunk]:
            try:
                batch.append(model.preprocess([path])[0])
                labels.append(label)
            except InputError as e:
                skipped.append((path, str(e)))
        if not batch:
            continue
        logits = _finite(model, model.scores(np.stack(batch)))
        picked = logits.argmax(1)
        best5 = np.argsort(-logits, axis=1, kind="stable")[:, :5]
        for label, pick, five in zip(labels, picked, best5):
            confusion[label, pick] += 1
            top5 += int(label in five)
            count += 1
    correct = np.diag(confusion)
    totals = confusion.sum(1)
    per_class = {name: (100.0 * correct[i] / totals[i] if totals[i] else None, int(totals[i]))
                 for i, name in enumerate(model.class_names())}
    return {"images": count, "top1": 100.0 * correct.sum() / max(count, 1),
            "top5": 100.0 * top5 / max(count, 1) if n > 5 else None,  # 100 % by definition with 5 classes or fewer
            "per_class": per_class, "confusion": confusion.tolist(), "skipped": skipped}


def confusion_png(result, class_names, path):
    """The confusion matrix as a PNG (headless matplotlib), counts in the cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = np.array(result["confusion"])
    size = max(4.0, 0.45 * len(class_names) + 2)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(m, cmap="Blues")
    ax.set_xticks(range(len(class_names)), class_names, rotation=90, fontsize=8)
    ax.set_yticks(range(len(class_names)), class_names, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true class")
    ax.set_title(f"top-1 {result['top1']:.2f}% on {result['images']:,} images")
    if len(class_names) <= 30:
        for i in range(len(m)):
            for j in range(len(m)):
                if m[i, j]:
                    ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if m[i, j] > m.max() / 2 else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _check_batches(model):
    """An InputError now, before any output, for a file that takes a fixed batch of several images: predict and
    eval feed batches of any size (a fixed batch of one is run an image at a time, OnnxModel.scores)."""
    if model.fixed_batch not in (None, 1):
        raise fixed_batch_error(model.path, model.fixed_batch, "compress feeds batches of any size")


def _finite(model, logits, paths=None):
    """`logits`, or an InputError naming the file for NaN or inf scores (and the first image of `paths` given
    them): no class is the answer then, and argmax would say class 0."""
    bad = ~np.isfinite(logits).all(axis=tuple(range(1, logits.ndim)))
    if bad.any():
        which = f"'{printable(paths[int(bad.argmax())], 300)}'" if paths else "the validation images"
        raise InputError(f"'{model.path}' gives non-finite scores (NaN or inf) for {which}; re-export the model")
    return logits


def _softmax(logits):
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)
