"""The run report: one row per artifact (teacher, student, QAT int8, fp32 ONNX, int8 ONNX) with parameters,
size, validation accuracy and onnxruntime latency; written as report.md, report.json and report.png."""

import json
import os

from compress.checkpoint import atomic_write_bytes, atomic_write_json, atomic_write_text

COLUMNS = ("artifact", "file", "params", "size_bytes", "val_acc", "latency_b1_ms", "latency_b64_ms")


def build_rows(run):
    """Rows from the manifest and export.json; missing stages simply give fewer rows."""
    stages = run.manifest()["stages"]
    done = {k: v for k, v in stages.items() if v.get("status") == "complete"}
    export = _read_json(run.path("export", "export.json")) if "export" in done else None
    rows = []

    def size(rel):
        path = run.path(rel)
        return os.path.getsize(path) if os.path.isfile(path) else None

    def latency(kind):
        if not export or kind not in export.get("latency_ms", {}):
            return None, None
        cells = export["latency_ms"][kind]
        best = max(c["threads"] for c in cells)
        pick = {c["batch"]: c["ms"] for c in cells if c["threads"] == best}
        return pick.get(1), pick.get(max(pick))

    if "teacher" in done:
        m = done["teacher"]["metrics"]
        rows.append(_row("teacher (PyTorch fp32)", "teacher/model.safetensors", m.get("params"),
                         size("teacher/model.safetensors"), m.get("val_acc"), *latency("teacher")))
    if "distill" in done:
        m = done["distill"]["metrics"]
        rows.append(_row("student (PyTorch fp32)", "distill/model.safetensors", m.get("params"),
                         size("distill/model.safetensors"), m.get("val_acc"), None, None))
    if "qat" in done:
        m = done["qat"]["metrics"]
        rows.append(_row("student QAT int8 (PyTorch)", "qat/qat.safetensors", m.get("params"), None,
                         m.get("int8_acc"), None, None))
    if export:
        params = (done.get("qat") or {}).get("metrics", {}).get("params")
        for kind in ("fp32", "int8"):
            rel = f"export/model.{kind}.onnx"
            rows.append(_row(f"{kind} ONNX (onnxruntime)", rel, params, size(rel), export[kind]["onnx_acc"],
                             *latency(kind)))
    return rows


def _row(artifact, file, params, size_bytes, val_acc, b1, b64):
    return dict(zip(COLUMNS, (artifact, file, params, size_bytes, val_acc, b1, b64)))


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def markdown_table(rows):
    lines = ["| artifact | params | size | val acc | latency b1 | latency b64 |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['artifact']} | {_fmt_int(r['params'])} | {_fmt_size(r['size_bytes'])} | "
                     f"{_fmt(r['val_acc'], '{:.2f}%')} | {_fmt(r['latency_b1_ms'], '{:.3f} ms')} | "
                     f"{_fmt(r['latency_b64_ms'], '{:.2f} ms')} |")
    return "\n".join(lines)


def _fmt(value, pattern):
    return "-" if value is None else pattern.format(value)


def _fmt_int(value):
    return "-" if value is None else f"{value:,}"


def _fmt_size(value):
    if value is None:
        return "-"
    return f"{value / 1e6:.2f} MB" if value >= 1e6 else f"{value / 1e3:.0f} KB"


def write_report(run):
    """Write report.md/json/png into the run dir; return the rows."""
    rows = build_rows(run)
    export = _read_json(run.path("export", "export.json"))
    atomic_write_json(run.path("report.json"), {"rows": rows, "export_checks": (export or {}).get("checks")})
    text = [f"# compress report: {os.path.basename(run.root)}", "", markdown_table(rows), ""]
    if export:
        text += ["Latency: onnxruntime CPU, median ms per batch, all cores. int8/fp32 size ratio "
                 f"{export['size_ratio_int8_fp32']:.3f}; int8 kernels: {', '.join(export['int8_kernels']) or 'none'}.",
                 ""]
    if rows:
        text += ["![accuracy vs size and latency](report.png)", ""]
        plot(rows, run.path("report.png"))
    atomic_write_text(run.path("report.md"), "\n".join(text))
    return rows


def plot(rows, path):
    """Accuracy against size and against batch-64 latency (headless matplotlib)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "size_bytes", "size (KB, log scale)"),
                           (axes[1], "latency_b64_ms", "onnxruntime latency, batch 64 (ms, log scale)")):
        points = [r for r in rows if r[key] is not None and r["val_acc"] is not None]
        for r in points:
            x = r[key] / 1e3 if key == "size_bytes" else r[key]
            ax.scatter(x, r["val_acc"], s=60)
            ax.annotate(r["artifact"], (x, r["val_acc"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
        if points:
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("validation accuracy (%)")
        ax.grid(True, alpha=0.3)
    axes[0].set_title("accuracy vs size")
    axes[1].set_title("accuracy vs latency")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
