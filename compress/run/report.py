"""The run report: one row per artifact (teacher, student, QAT int8, fp32 ONNX, int8 ONNX) with parameters,
size, validation accuracy and onnxruntime latency; written as report.md, report.json and report.png.

The report knows no stage's files: each stage module's `report_rows(entry, path)` gives its rows, reading its
own declared OUTPUTS. A row from a stage that is not complete-and-current (an upstream stage ran again since)
is kept but marked stale, with the reason; a figure one stage measured for another's row (the teacher's
latency, timed by export) is shown only while the file it was measured on is still current.
"""

import logging
import os

from compress.errors import CompressError
from compress.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)

COLUMNS = ("artifact", "file", "params", "size_bytes", "val_acc", "latency_b1_ms", "latency_b64_ms")


def evaluated_in(metrics):
    """How a PyTorch row's accuracy was measured: "PyTorch fp32", or "PyTorch, evaluated in bf16" when the stage
    validated its fp32 weights under bf16 autocast (the fp32 ONNX row of the same weights can differ by a few
    tenths of a point: that is the autocast, not the export)."""
    precision = metrics.get("precision") or "fp32"
    return "PyTorch fp32" if precision == "fp32" else f"PyTorch, evaluated in {precision}"


def file_size(path):
    return os.path.getsize(path) if path and os.path.isfile(path) else None


def build_rows(run, stages):
    """(rows, notes) for the stages in `stages` (name -> stage module), from the manifest and their files."""
    from compress.run.state import files_changed, stage_states

    manifest = run.manifest()
    states = stage_states(run, stages, manifest)
    rows, notes = {}, []
    for name, spec in stages.items():
        entry = manifest["stages"].get(name) or {}
        state, detail = states[name]
        if state in ("failed", "interrupted"):
            notes.append(f"{name} {state}: {detail}" if detail else f"{name} {state}")
        if entry.get("status") != "complete" or not hasattr(spec, "report_rows"):
            continue
        try:
            produced = spec.report_rows(entry, lambda output, spec=spec: run.path(spec.OUTPUTS[output]))
        except (CompressError, KeyError, TypeError, ValueError, IndexError) as e:  # a damaged file: say so, go on
            notes.append(f"{name}: no rows - its files are damaged ({e.__class__.__name__}: {str(e)[:120]}); "
                         f"rerun it with --stages {name} --force")
            continue
        changed = files_changed(run, entry.get("outputs", {}), [r["file"] for r in produced if r.get("file")])
        if state != "complete":
            notes.append(f"{name} is stale ({detail}): its rows are marked; `compress run` brings it up to date")
        elif changed:
            notes.append(f"{name}: {', '.join(changed)} changed after the stage wrote it: its figures are not that "
                         f"file's, and the rows are marked; `compress run` writes it again")
        elif hasattr(spec, "report_notes"):
            notes.extend(spec.report_notes(entry))
        for row in produced:
            if "artifact" not in row:  # a figure for another stage's row, measured from that stage's file
                if row["id"] in rows and _still_current(row.pop("measured_from"), entry, manifest, states):
                    rows[row["id"]].update({k: v for k, v in row.items() if k != "id"})
                continue
            rows[row["id"]] = {**dict.fromkeys(COLUMNS), **row, "stage": name,
                               "current": state == "complete" and row.get("file") not in changed}
    return [r for r in rows.values() if "artifact" in r and r["artifact"]], notes


def _still_current(rel, entry, manifest, states):
    """The file `rel` that `entry`'s stage read is still the current output of a current stage."""
    owner = rel.split("/")[0]
    current = (manifest["stages"].get(owner) or {}).get("outputs", {}).get(rel)
    return entry.get("inputs", {}).get(rel) == current and states.get(owner, ("",))[0] == "complete"


def markdown_table(rows):
    lines = ["| artifact | params | size | val acc | latency b1 | latency b64 |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = r["artifact"] + ("" if r.get("current", True) else " *(stale)*")
        lines.append(f"| {name} | {_fmt_int(r['params'])} | {_fmt_size(r['size_bytes'])} | "
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


LATENCY_CAPTION = ("Latency: median ms per batch on the most threads measured; in onnxruntime the ONNX files take "
                   "turns, round by round, so a busy machine slows them alike (the teacher is timed on its own). "
                   "The deploy verdict below times fp32 and the int8 file it weighs once more and takes each one's "
                   "fastest run, so its figures can differ a little from the table's medians.")


def write_report(run, stages):
    """Write report.md/json/png into the run dir; return the rows."""
    rows, notes = build_rows(run, stages)
    atomic_write_json(run.path("report.json"), {"rows": rows, "notes": notes})
    text = [f"# compress report: {os.path.basename(run.root)}", "", markdown_table(rows), ""]
    text += [LATENCY_CAPTION, ""] if rows else []
    text += [f"- {note}" for note in notes] + ([""] if notes else [])
    if rows:
        text += ["![accuracy vs size and latency](report.png)", ""]
        plot(rows, run.path("report.png"))
    atomic_write_text(run.path("report.md"), "\n".join(text))
    return rows


def plot(rows, path):
    """Accuracy against size and against batch-64 latency (headless matplotlib). Every artifact has its own
    marker and colour, named in one legend below the plots (labels beside points overlapped whenever two
    points were close); the teacher's latency is that of its fp32 ONNX export, and says so."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    markers = "osD^vP*Xhp<>"
    rows = [r for r in rows if r["val_acc"] is not None and (r["size_bytes"] is not None or  # drawn in a plot:
                                                              r["latency_b64_ms"] is not None)]  # in the legend
    style = {r["artifact"]: (f"C{i % 10}", markers[i % len(markers)]) for i, r in enumerate(rows)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, key, label in ((axes[0], "size_bytes", "file size (KB, log scale)"),
                           (axes[1], "latency_b64_ms", "latency, batch 64, all cores (ms, log scale)")):
        xs, ys = [], []
        for r in rows:
            if r[key] is None or r["val_acc"] is None:
                continue
            x = r[key] / 1e3 if key == "size_bytes" else r[key]
            color, marker = style[r["artifact"]]
            ax.scatter(x, r["val_acc"], s=60, color=color, marker=marker, zorder=3, alpha=0.85,
                       edgecolors="black" if r.get("current", True) else "none")
            xs.append(x)
            ys.append(r["val_acc"])
        if xs:
            ax.set_xscale("log")
            ax.set_xlim(min(xs) / 1.6, max(xs) * 1.6)
            spread = max(max(ys) - min(ys), 0.5)
            ax.set_ylim(min(ys) - spread * 0.2, max(ys) + spread * 0.2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(label)
        ax.set_ylabel("validation accuracy (%)")
        ax.grid(True, alpha=0.3, which="both")
    axes[0].set_title("accuracy vs size")
    axes[1].set_title("accuracy vs latency (the teacher: its fp32 ONNX export)")
    handles = [plt.Line2D([], [], linestyle="", marker=m, color=c, markersize=8, markeredgecolor="black")
               for c, m in style.values()]
    names = [name + ("" if r.get("current", True) else " (stale)") for name, r in zip(style, rows)]
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08 + 0.025 * ((len(names) + 1) // 2), 1, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
