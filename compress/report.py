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
    """Accuracy against size and against batch-64 latency (headless matplotlib). Artifacts that land on the
    same point (the student in PyTorch and as fp32 ONNX) share one marker and one label."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    colors = {r["artifact"]: f"C{i}" for i, r in enumerate(rows)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "size_bytes", "size (KB, log scale)"),
                           (axes[1], "latency_b64_ms", "onnxruntime latency, batch 64, all cores (ms, log scale)")):
        points = {}
        for r in rows:
            if r[key] is None or r["val_acc"] is None:
                continue
            x = r[key] / 1e3 if key == "size_bytes" else r[key]
            spot = next((p for p in points if abs(p[0] / x - 1) < 0.05 and abs(p[1] - r["val_acc"]) < 1e-9),
                        (x, r["val_acc"]))
            points.setdefault(spot, []).append(r["artifact"])
        for (x, y), names in points.items():
            ax.scatter(x, y, s=70, color=colors[names[-1]], zorder=3)
            ax.annotate(" +\n".join(names), (x, y), textcoords="offset points", xytext=(8, -4), fontsize=8,
                        va="top")
        if points:
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            ax.set_xscale("log")
            ax.set_xlim(min(xs) / 2, max(xs) * 6)
            spread = max(max(ys) - min(ys), 0.5)
            ax.set_ylim(min(ys) - spread * 0.35, max(ys) + spread * 0.2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(label)
        ax.set_ylabel("validation accuracy (%)")
        ax.grid(True, alpha=0.3, which="both")
    axes[0].set_title("accuracy vs size")
    axes[1].set_title("accuracy vs latency")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
