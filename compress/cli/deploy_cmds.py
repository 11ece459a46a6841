"""`compress predict`, `compress eval` and `compress bench`: the deployment side, in the registered runtimes only
(compress.deploy.runtimes)."""

import dataclasses
import os

import click

from compress.cli.base import cli, debug_option, echo
from compress.cpus import usable_cpus
from compress.deploy.runtimes import FIRST, RUNTIMES, bench_help
from compress.errors import EXIT_BAD_INPUT, InputError
from compress.fileio import one_line


def _int_list(value, name, most):
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        items = []
    if not items or min(items) < 1 or max(items) > most or len(items) > 32:
        raise click.BadParameter(f"expected comma-separated positive whole numbers up to {most}, got '{value[:80]}'",
                                 param_hint=name)
    if len(set(items)) < len(items):
        raise click.BadParameter(f"give each value once, got '{value[:80]}'", param_hint=name)
    return items


def _model(path):
    """The OnnxModel for an .onnx file or a run directory (its export verdict's file), and says which."""
    from compress.deploy.evaluate import deployed_file, run_of
    from compress.deploy.onnx_model import OnnxModel

    file, note = deployed_file(path)
    if note:
        echo(f"using {note}", err=True)
        _warn_if_unverified(run_of(path), file)
    return OnnxModel(file)


def _warn_if_unverified(run_dir, *files):
    """Say when a run's deployed file is not what a finished export verified: export ran again upstream (stale),
    failed its checks, the file - or export.json, whose verdict chose it - was changed after export wrote it, or
    the manifest that would tell cannot be read. Only warnings: a folder without a readable manifest still serves
    its files."""
    from compress.deploy import export_report
    from compress.errors import CompressError
    from compress.run.rundir import RunDir, lock_holder
    from compress.run.state import files_changed, stage_states
    from stages import ORDER

    run = RunDir(run_dir)
    try:
        state, detail = stage_states(run, ORDER)["export"]
        recorded = (run.manifest()["stages"].get("export") or {}).get("outputs", {})
        changed = files_changed(run, recorded, [os.path.relpath(f, run_dir).replace(os.sep, "/") for f in files
                                                if os.path.isfile(f)])  # a missing one: its own error follows
        report = f"export/{export_report.FILE}"
        edited = files_changed(run, recorded, [report])  # the verdict that named these files
    except CompressError as e:
        echo(f"warning: {e} - so {', '.join(os.path.basename(f) for f in files)} cannot be checked against what "
             "export verified", err=True)
        return
    fix = f"`compress run --run-dir {run_dir}` brings the run up to date (it skips what already is)"
    holder = lock_holder(run) if state not in ("complete", "invalidated", "failed") else ""
    if state == "invalidated":
        echo(f"warning: export is stale ({detail}): these files were made before that; {fix}", err=True)
    elif state == "failed":
        echo(f"warning: the last export failed ({detail.split(';')[0]}): its files are kept for inspection, "
                   f"not verified for deployment; {fix}", err=True)
    elif holder:  # a run is at work in the directory now
        echo(f"warning: a compress run is working in {run_dir} now ({holder}): these files may be "
             "rewritten while you use them; wait for it to finish", err=True)
    elif state != "complete":  # interrupted or killed part-way: some files may be rewritten, others older
        echo(f"warning: the last export did not finish ({state}): its files may be partly from an earlier "
                   f"export; {fix}", err=True)
    else:
        if edited:  # its verdict may name any file, for any reason: nothing export weighed
            echo(f"warning: {report} changed after export wrote it: its verdict "
                 f"({', '.join(os.path.basename(f) for f in files)}) is not verified; rerun `compress run --run-dir "
                 f"{run_dir} --stages export --force` to have export weigh the files and write it again", err=True)
        if changed:
            echo(f"warning: {' and '.join(changed)} changed after export wrote and checked "
                 f"{'them' if len(changed) > 1 else 'it'}; {fix}", err=True)


def _warn_if_training_images(model, root, samples=()):
    """Say when the folder eval scores holds the images the model's run trained on: its flat data.root (split by
    seed: most of it is training images) or its train/ folder - that accuracy is not a held-out one."""
    from compress.deploy.evaluate import run_of
    from compress.deploy.folders import split_folders
    from compress.errors import CompressError
    from compress.run.config import load_config

    run = run_of(model) if os.path.isdir(model) else os.path.dirname(os.path.dirname(os.path.abspath(model)))
    try:
        data = load_config(os.path.join(run, "config.yaml"), follow_links=False, run_config=True).data
    except (CompressError, OSError):  # no run beside the model, or not one this version reads: nothing to say
        return
    if data.name != "imagefolder" or not data.root:
        return
    trained = os.path.expanduser(str(data.root))
    train, held_out = split_folders(trained)
    trained = train if train and held_out else (train or trained)
    if os.path.isdir(trained) and os.path.realpath(root) == os.path.realpath(trained):
        echo(f"warning: '{root}' holds the images this model was trained on (data.root of {run}): the "
                   "accuracy below is not a held-out one; evaluate on images it has not seen", err=True)
    elif samples:
        _warn_if_copies(data, root, samples)


def _warn_if_copies(data, root, samples):
    """Say when images of the folder eval scores are byte copies of the run's training images (a folder copied
    from data.root): some evaluated images, or a sample of a large folder, compared by size, then sha256."""
    from compress.data.imagefolder import copies_of_training_images, scan
    from compress.errors import CompressError

    try:
        looked, copies = copies_of_training_images(scan(data)["train"], samples)
    except (CompressError, OSError):  # the training images are gone or changed: nothing to compare with
        return
    if copies:
        echo(f"warning: {len(copies)} of the {len(looked)} {'sampled ' if len(looked) < len(samples) else ''}images "
             f"in '{root}' are byte-identical copies of images this model was trained on (e.g. '{copies[0][0]}' of "
             f"'{copies[0][1]}'): the accuracy below counts them, which reads higher than on new photos", err=True)


@cli.command()
@click.argument("model", type=click.Path())
@click.argument("images", nargs=-1, required=True)
@click.option("--top-k", type=click.IntRange(1, 1000), default=3, show_default=True, help="Classes to show per image.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@debug_option
def predict(model, images, top_k, as_json):
    """Classify images with an exported model (onnxruntime + numpy + Pillow only).

    MODEL is an .onnx file, or a run directory: then the file its export verdict names (the QAT int8, the PTQ
    int8 or the fp32 file). IMAGES are files, folders (every image below them) or glob patterns. Preprocessing and
    class names are read from the model file. A file that cannot be read is skipped with one line, and the
    command exits 2 at the end.

    \b
    Examples:
      compress predict artifacts/default digit1.png digit2.png
      compress predict artifacts/default/export/model.int8.onnx photos/ 'more/*.jpg' --top-k 1
    """
    import json
    from collections import Counter

    from compress.deploy.evaluate import image_paths, predict_files
    from compress.deploy.imageio import IMAGE_EXTENSIONS
    from compress.errors import InputError
    from compress.fileio import one_line

    others = Counter()
    paths = image_paths(images, others)
    if others:
        kinds = ", ".join(f"{n:,} {one_line(suffix)}" for suffix, n in sorted(others.items(), key=lambda kv: (-kv[1],
                                                                                                           kv[0]))[:5])
        echo(f"note: left out {sum(others.values()):,} file(s) in the folders given that are not images compress "
             f"reads ({kinds}); convert them to one of {', '.join(IMAGE_EXTENSIONS)} to classify them", err=True)
    if not paths:
        raise InputError(f"no images in {', '.join(repr(i) for i in images[:3])}{' ...' if len(images) > 3 else ''}: "
                         "give image files, folders holding images (.jpg, .png, .bmp, .tif, .webp, ...), or glob "
                         "patterns")
    if len(paths) > 1_000_000:
        raise click.BadParameter("at most 1,000,000 images per call", param_hint="IMAGES")
    onnx_model = _model(model)
    results, skipped = [], 0
    for path, top, error in predict_files(onnx_model, paths, top_k):
        if error:
            skipped += 1
            echo(f"skipped: {one_line(error)}", err=True)
            if as_json:  # in the JSON too, where a script looks
                results.append({"image": path, "error": error})
            continue
        if as_json:
            results.append({"image": path, "top": [{"class": c, "probability": round(p, 6)} for c, p in top]})
        else:
            echo(f"{one_line(path)}: " + ", ".join(f"{c} ({p:.1%})" for c, p in top))
    if as_json:
        echo(json.dumps(results, indent=2))
    if skipped:
        echo(f"error: {skipped} of {len(paths)} image(s) could not be read (listed above)", err=True)
        click.get_current_context().exit(EXIT_BAD_INPUT)


@cli.command("eval")
@click.argument("model", type=click.Path())
@click.argument("folder", type=click.Path())
@click.option("--png", type=click.Path(dir_okay=False), help="Also draw the confusion matrix into this PNG file.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@debug_option
def eval_cmd(model, folder, png, as_json):
    """Measure an exported model's accuracy on a labelled image-folder tree.

    MODEL is an .onnx file or a run directory (its recommended file). FOLDER holds one folder per class
    (<class>/<image>), named like the model's classes; a folder with train/ and val/ (or training/; valid/,
    validation/, dev/, test/, testing/) is evaluated on that split. Prints top-1 accuracy (and top-5 above 5
    classes), accuracy per class and the confusion matrix (rows: true class, columns: predicted), with the file's
    own preprocessing.

    \b
    Examples:
      compress eval artifacts/cifar10 ~/data/cifar10/val
      compress eval artifacts/cifar10/export/model.int8.onnx ~/data/cifar10 --png confusion.png
    """
    import json

    from compress.deploy.evaluate import check_png_path, confusion_png, evaluate_tree, labelled_tree, unread_note

    if png:
        check_png_path(png)
    onnx_model = _model(model)
    names = onnx_model.class_names()
    if png and len(names) > SHOWN_CLASSES:
        raise InputError(f"--png draws the confusion matrix of up to {SHOWN_CLASSES} classes; '{onnx_model.path}' "
                         f"has {len(names):,}: leave --png out (--json holds the matrix)")
    root, samples = labelled_tree(folder, list(onnx_model.meta["class_names"]))
    note = unread_note(root, samples, list(onnx_model.meta["class_names"]))
    if note:
        echo(f"note: {note}", err=True)
    _warn_if_training_images(model, root, samples)
    result = evaluate_tree(onnx_model, samples)
    for path, error in result["skipped"]:
        echo(f"skipped: {one_line(error)}", err=True)
    if png:
        confusion_png(result, names, png)
    if as_json:
        echo(json.dumps({**result, "folder": root, "model": onnx_model.path}, indent=2))
    else:
        _print_eval(result, names, root, onnx_model.path, png)
    if result["skipped"]:
        echo(f"error: {len(result['skipped'])} image(s) could not be read (listed above)", err=True)
        click.get_current_context().exit(EXIT_BAD_INPUT)


SHOWN_CLASSES = 100  # the confusion matrix eval prints and draws, at most this many classes a side


def _print_eval(result, names, root, model_path, png):
    echo(f"{model_path} on {root}: {result['images']:,} images")
    five = f"   top-5 {result['top5']:.2f}%" if result["top5"] is not None else ""
    echo(f"top-1 {result['top1']:.2f}%{five}")
    width = max(len(n) for n in names)
    echo("\nper class:")
    for name, (acc, count) in result["per_class"].items():
        if count:
            echo(f"  {name:{width}}  {acc:6.2f}%  of {count:,}")
    if len(names) > SHOWN_CLASSES:  # 10,000 classes would print a matrix of 100 million cells
        echo(f"\nconfusion matrix: {len(names):,} x {len(names):,} classes, in --json")  # --png was refused
        return
    cols = [n[:5] for n in names]
    echo("\nconfusion (rows: true class, columns: predicted)")
    echo(" " * (width + 2) + " ".join(f"{c:>5}" for c in cols))
    for name, row in zip(names, result["confusion"]):
        echo(f"  {name:{width}}" + " ".join(f"{v:>5}" for v in row))
    if png:
        echo(f"\nconfusion matrix drawn in {png}")


@cli.command()
@click.argument("models", nargs=-1, required=True, type=click.Path())
@click.option("--batch", default=None, help="Comma-separated batch sizes [default: 1,64; for a run directory, its "
                                            "export.latency_batch_sizes].")
@click.option("--threads", default=None, help="Comma-separated thread counts [default: 1,<all cores>; for a run "
                                              "directory, its export.latency_threads when set].")
@click.option("--repeats", type=click.IntRange(1, 100_000), default=None,
              help="Most timed runs of a file in each of the 5 interleaved rounds (each round up to 0.05 s a file) "
                   "[default: 30; for a run directory, its export.latency_repeats].")
@click.option("--warmup", type=click.IntRange(0, 10_000), default=None,
              help="Untimed runs of each file first [default: 5; for a run directory, its export.latency_warmup].")
@click.option("--runtime", type=click.Choice(tuple(RUNTIMES)), default=FIRST, show_default=True, help=bench_help())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@debug_option
def bench(models, batch, threads, repeats, warmup, runtime, as_json):
    """Time ONNX files the way the export stage times them: every file in every cell (batch size x thread count),
    the files taking turns in 5 interleaved rounds so a busy machine slows them alike; a cell's figure is the
    median over the rounds of each round's fastest call, on random pixels normalised as the file says. The
    report's latency table and the export verdict are these figures.

    MODELS are .onnx files (up to 8; the others are compared with the first), or a run directory: then the files
    its export verdict weighed (fp32, QAT int8, PTQ int8), timed with its export.latency_* settings.

    \b
    Examples:
      compress bench artifacts/default
      compress bench artifacts/default/export/model.int8.onnx --batch 1,64 --threads 1,2
      compress bench artifacts/default/export/model.fp32.onnx artifacts/default/export/model.int8.onnx
      compress bench artifacts/default --runtime openvino --json
    """
    import json

    from compress.cpus import BusyMeter
    from compress.deploy.latency import default_threads, latency_tables, protocol

    if len(models) > 8:
        raise click.BadParameter("give at most 8 ONNX files, or one run directory", param_hint="MODELS")
    settings = (None, None, None, None)
    if len(models) == 1 and os.path.isdir(models[0]):
        models, settings = _run_files(models[0])
    from compress.deploy.evaluate import run_hint

    for path in models:
        if not os.path.exists(path) and not str(path).lower().endswith(".onnx"):  # as predict and eval say it
            usage = "; pass .onnx files, or a run directory whose export stage ran"
            raise InputError(f"'{path}' does not exist{run_hint(path) or usage}")
        RUNTIMES[runtime].check(path)  # a clear error for a missing or non-ONNX file, or a missing runtime
    batches = _int_list(batch, "--batch", 4096) if batch else list(settings[0] or (1, 64))
    thread_list = _int_list(threads, "--threads", 1024) if threads else list(settings[3] or default_threads())
    repeats = repeats or settings[1] or 30
    warmup = next(w for w in (warmup, settings[2], 5) if w is not None)
    names = dict(zip("ABCDEFGH", models))
    with BusyMeter() as meter:
        tables = latency_tables(names, batches, thread_list, repeats, warmup, runtime=runtime)
    crowded = _say_if_crowded(meter.busy)
    how = (f"{runtime}, CPU: ms of a call, the median over {protocol().rounds} interleaved rounds of each round's "
           f"fastest; a round runs a file up to {protocol().round_s:g} s or {repeats} times, after {warmup} "
           "warm-up runs")
    if as_json:
        echo(json.dumps({"runtime": runtime, "protocol": dataclasses.asdict(protocol(repeats, warmup)),
                               "cpus_busy": meter.busy, "files": [{"label": k, "path": str(p), "cells": tables[k]}
                                                            for k, p in names.items()]}, indent=2))
    elif len(names) == 1:
        _print_one(models[0], tables["A"], how)
    else:
        _print_compared(names, tables, how)
    if not as_json:
        _print_fewer_threads(names, tables, crowded)


def _say_if_crowded(busy):
    """Whether other processes kept CPUs busy while the files were timed (said once, as the report says it)."""
    from compress.quant.verdict import BUSY

    if busy is None or busy < BUSY:
        return False
    echo(f"note: other processes kept {busy:.1f} of this machine's {usable_cpus()} usable CPUs busy while the files "
         "were timed: these figures are noisy; time again on a quiet machine", err=True)
    return True


def _run_files(path):
    """(the files a run directory's export verdict weighed, (batch sizes, repeats, warm-up, thread counts) of its
    config)."""
    from compress.deploy.evaluate import run_files
    from compress.errors import CompressError
    from compress.run.config import load_config

    run, files = run_files(path)
    _warn_if_unverified(run, *files.values())
    try:
        e = load_config(os.path.join(run, "config.yaml"), follow_links=False, run_config=True).export
    except (CompressError, OSError):  # a run directory without a readable config: bench's own defaults
        return tuple(files.values()), (None, None, None, None)
    return tuple(files.values()), (e.latency_batch_sizes, e.latency_repeats, e.latency_warmup, e.latency_threads)


def _print_one(path, cells, how):
    echo(f"{path} ({how})")
    echo(f"{'batch':>6} {'threads':>8} {'ms':>10} {'images/s':>12}")
    for c in cells:
        echo(f"{c['batch']:>6} {c['threads']:>8} {c['ms']:>10.3f} {c['images_per_s']:>12,.0f}")


def _print_fewer_threads(names, tables, crowded):
    from compress.deploy.timing import fewer_threads, threads_text

    lines = [(label if len(names) > 1 else "the file", batch, threads_text(threads), ms, most, most_ms)
             for label, cells in tables.items() for batch, threads, ms, most, most_ms in fewer_threads(cells)]
    for i, (who, batch, few, ms, most, most_ms) in enumerate(lines):
        why = " - too little work per layer to split" if i == 0 else ""  # the reason once, not on every line
        echo(f"{who} at batch {batch}: faster on {few} ({ms:.3f} ms) than on {most} ({most_ms:.3f} ms){why}; give "
             f"the runtime {few} for batches of {batch}")
    if lines and crowded:  # said once for all of them
        echo("(measured while other processes kept CPUs busy, where fewer threads win because the others are taken: "
             "time again on a quiet machine before acting on these lines)")


def _print_compared(names, tables, how):
    from compress.deploy.latency import speedup_text

    for label, path in names.items():
        echo(f"{label} = {path}")
    echo(f"({how})")
    echo(f"{'batch':>6} {'threads':>8} " + " ".join(f"{label + ' ms':>10}" for label in names) + "  vs A")
    for i, first in enumerate(tables["A"]):
        row = {label: tables[label][i]["ms"] for label in names}
        against = ", ".join(f"{label} is {speedup_text(row['A'] / ms)}" for label, ms in row.items() if label != "A")
        echo(f"{first['batch']:>6} {first['threads']:>8} " + " ".join(f"{ms:>10.3f}" for ms in row.values())
                   + f"  {against} than A")
