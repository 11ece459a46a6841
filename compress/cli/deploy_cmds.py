"""`compress predict` and `compress bench`: the deployment side, onnxruntime only."""

import click

from compress.cli.base import cli, debug_option


def _int_list(value, name, most):
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        items = []
    if not items or min(items) < 1 or max(items) > most or len(items) > 32:
        raise click.BadParameter(f"expected comma-separated positive whole numbers up to {most}, got '{value[:80]}'",
                                 param_hint=name)
    return items


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.argument("images", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--top-k", type=click.IntRange(1, 1000), default=3, show_default=True, help="Classes to show per image.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@debug_option
def predict(model, images, top_k, as_json):
    """Classify image files with an exported ONNX model (onnxruntime + numpy + Pillow only).

    Preprocessing (size, channels, mean/std) and class names are read from the model file.

    \b
    Example:
      compress predict artifacts/default/export/model.int8.onnx digit1.png digit2.png
    """
    from compress.deploy.onnx_model import OnnxModel

    if len(images) > 100_000:
        raise click.BadParameter("at most 100,000 images per call", param_hint="IMAGES")
    results = OnnxModel(model).predict(list(images), top_k=top_k)
    if as_json:
        import json

        click.echo(json.dumps([{"image": path, "top": [{"class": c, "probability": round(p, 6)} for c, p in top]}
                               for path, top in results], indent=2))
        return
    for path, top in results:
        click.echo(f"{path}: " + ", ".join(f"{c} ({p:.1%})" for c, p in top))


@cli.command()
@click.argument("models", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--batch", default="1,64", show_default=True, help="Comma-separated batch sizes.")
@click.option("--threads", default=None, help="Comma-separated thread counts [default: 1,<all cores>].")
@click.option("--repeats", type=click.IntRange(1, 100_000), default=30, show_default=True,
              help="Timed runs per cell (one model); with two models, interleaved rounds per cell.")
@click.option("--warmup", type=click.IntRange(0, 10_000), default=5, show_default=True, help="Untimed runs first.")
@debug_option
def bench(models, batch, threads, repeats, warmup):
    """Time ONNX models with onnxruntime: latency per batch size and thread count.

    Given one file: its median latency per cell. Given two (e.g. fp32 and int8), both are timed side by side,
    interleaved in rounds so a busy machine slows them alike, and the table shows each one's best time, the
    ratio, and which is faster.

    \b
    Examples:
      compress bench artifacts/default/export/model.int8.onnx --batch 1,64 --threads 1,2
      compress bench artifacts/default/export/model.fp32.onnx artifacts/default/export/model.int8.onnx
    """
    from compress.deploy.latency import latency_table
    from compress.deploy.onnx_model import OnnxModel

    if len(models) > 2:
        raise click.BadParameter("give one ONNX file, or two to compare", param_hint="MODELS")
    for path in models:
        OnnxModel(path, require_metadata=False)  # a clear error for a missing or non-ONNX file
    batches = _int_list(batch, "--batch", 4096)
    thread_list = _int_list(threads, "--threads", 1024) if threads else None
    if len(models) == 2:
        _compare(models, batches, thread_list, max(3, min(repeats, 50) // 5), warmup)
        return
    rows = latency_table(models[0], batches, thread_list, repeats, warmup)
    click.echo(f"{models[0]} (onnxruntime, CPU, median of {repeats})")
    click.echo(f"{'batch':>6} {'threads':>8} {'ms':>10} {'images/s':>12}")
    for r in rows:
        click.echo(f"{r['batch']:>6} {r['threads']:>8} {r['ms']:>10.3f} {r['images_per_s']:>12,.0f}")


def _compare(paths, batches, threads, rounds, warmup):
    import os

    import numpy as np

    from compress.deploy.latency import compare_latency, speedup_text
    from compress.deploy.onnx_model import OnnxModel

    a, b = (os.path.basename(p) for p in paths)
    click.echo(f"A = {paths[0]}\nB = {paths[1]}\n(onnxruntime, CPU, best of {rounds} interleaved rounds)")
    click.echo(f"{'batch':>6} {'threads':>8} {'A ms':>10} {'B ms':>10}  B vs A")
    for t in threads or (1, os.cpu_count() or 1):
        sessions = {name: OnnxModel(p, threads=t, require_metadata=False) for name, p in zip("AB", paths)}
        for n in batches:
            x = np.random.default_rng(0).standard_normal((n, *sessions["A"].input_shape), dtype=np.float32)
            times = compare_latency(sessions, x, rounds=rounds, warmup=warmup)
            ratio = times["A"]["min_ms"] / times["B"]["min_ms"]
            click.echo(f"{n:>6} {t:>8} {times['A']['min_ms']:>10.3f} {times['B']['min_ms']:>10.3f}  "
                       f"{b} is {speedup_text(ratio)} than {a}")
