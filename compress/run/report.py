"""The run report: one row per artifact (teacher, student, QAT int8, fp32 ONNX, int8 ONNX) with parameters,
size, validation accuracy and onnxruntime latency; written as report.md, report.json and report.png.

The report knows no stage's files: each stage module's `report_rows(entry, path)` gives its rows, reading its
own declared OUTPUTS. A row from a stage that is not complete-and-current (an upstream stage ran again since)
is kept but marked stale, with the reason; a figure one stage measured for another's row (the teacher's
latency, timed by export) is shown only while the file it was measured on is still current.
"""

import logging
import math
import os
import re
import shlex

from compress.errors import CompressError
from compress.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text, safe_text, size_text
from compress.torchrun import run_command

log = logging.getLogger(__name__)

# latency_b64_ms: the largest batch timed, whatever it is - the batch size itself is in latency_batch
COLUMNS = ("artifact", "file", "params", "size_bytes", "val_acc", "latency_b1_ms", "latency_b64_ms", "latency_batch")


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
    refresh = f"{run_command()} --run-dir {shlex.quote(str(run.root))}"
    for name, spec in stages.items():
        entry = manifest["stages"].get(name) or {}
        state, detail = states[name]
        if state in ("failed", "interrupted"):
            notes.append(f"{name} {state}: {detail}" if detail else f"{name} {state}")
        if entry.get("status") != "complete" or not hasattr(spec, "report_rows"):
            continue
        try:
            produced = spec.report_rows(entry, lambda output, spec=spec: run.path(spec.OUTPUTS[output]))
        except CompressError as e:  # a damaged file, in a sentence that names it and what to do: go on
            notes.append(f"{name}: no rows - its files are damaged: {e}")
            continue
        except (KeyError, TypeError, ValueError, IndexError) as e:
            notes.append(f"{name}: no rows - its files are damaged ({e.__class__.__name__}: {str(e)[:120]}); "
                         f"rerun it with --stages {name} --force")
            continue
        # a row's figures come from its file, or from the stage's record of it ("record": export.json)
        changed = files_changed(run, entry.get("outputs", {}),
                                [r[k] for r in produced for k in ("file", "record") if r.get(k)])
        notes.extend(_implausible_figures(name, produced, refresh))
        batch = _largest_batch_timed(entry.get("metrics") or {})
        for row in produced:
            if batch and row.get("latency_b64_ms") is not None:
                row["latency_batch"] = batch
        if state != "complete":
            notes.append(f"{name} is stale ({detail}): its rows are marked; `{refresh}` brings it up to date")
        elif changed:
            notes.append(f"{name}: {', '.join(changed)} changed after the stage wrote it: its figures are not that "
                         f"file's, and the rows are marked; `{refresh} --stages {name} --force` writes it again")
        elif hasattr(spec, "report_notes"):
            try:
                notes.extend(spec.report_notes(entry, manifest, refresh))
            except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:  # a hand-edited figure
                notes.append(f"{name}: its notes are left out - a figure in manifest.json is damaged "
                             f"({e.__class__.__name__}); `{refresh} --stages {name} --force` writes it again")
        for row in produced:
            if "artifact" not in row:  # a figure for another stage's row, measured from that stage's file
                if row.pop("record", None) in changed:  # read from a record edited since: not that stage's figure
                    continue
                if row["id"] in rows and _still_current(row.pop("measured_from"), entry, manifest, states):
                    target, measured_on = rows[row["id"]], row.pop("latency_of", None)
                    target.update({k: v for k, v in row.items() if k != "id"})
                    if measured_on:  # its accuracy and its latency were measured on different files: say so
                        target["artifact"] = _with_note(target["artifact"], f"latency: {measured_on}")
                continue
            current = state == "complete" and not {row.get("file"), row.pop("record", None)} & set(changed)
            rows[row["id"]] = {**dict.fromkeys(COLUMNS), **row, "stage": name, "current": current,
                               "ship": bool(row.get("ship")) and current}  # a stale verdict recommends nothing
    return [r for r in rows.values() if "artifact" in r and r["artifact"]], notes


# the plausible range of each figure a row shows: anything else (a hand-edited 1e308, an integer of 400 digits, a
# string) is not a measurement, and formatting or plotting it would fail (float() of a huge integer overflows)
PLAUSIBLE = {"params": (0, 1e15), "size_bytes": (0, 1e15), "val_acc": (0, 100), "latency_b1_ms": (0, 1e9),
             "latency_b64_ms": (0, 1e9)}


def plausible(value, low=0, high=float("inf")):
    """`value` is a real number (not a bool) in [low, high]; an integer too large for a float is not."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and low <= float(value) <= high
    except OverflowError:
        return False


def _implausible_figures(name, produced, refresh="compress run"):
    """Set every figure of the rows `produced` by stage `name` that is not plausible (PLAUSIBLE) to None, shown as
    not available, and return one note per figure naming the file it was read from and its key ("damaged": `compress
    show` prints it beside the "-")."""
    notes = []
    for row in produced:
        for key, (low, high) in PLAUSIBLE.items():
            if row.get(key) is not None and not plausible(row[key], low, high):
                row[key] = None
                source = row.get("record") or f"manifest.json (stage '{name}')"
                notes.append(f"{name}: the {key} of the {row.get('artifact') or row['id']} row in {source} is "
                             f"damaged (not a number from {low:g} to {high:g}) and is shown as not available; correct "
                             f"it, or rerun it: `{refresh} --stages {name} --force`")
    return notes


_CELL = re.compile(r"b(\d+)_t\d+")  # a latency cell's key in a stage's metrics: batch and threads


def _largest_batch_timed(metrics):
    """The largest batch size a stage timed (its metrics' latency_ms: {file: {"b<batch>_t<threads>": ms}}), which
    its rows' latency_b64_ms is of; None when it timed none."""
    batches = [int(m.group(1)) for cells in (metrics.get("latency_ms") or {}).values() if isinstance(cells, dict)
               for m in map(_CELL.fullmatch, cells) if m]
    return max(batches, default=None)


def latency_batch(rows):
    """The batch size of the rows' second latency column (the largest timed): 8 for export.latency_batch_sizes
    [1, 8]; None when no row says (no latency figures)."""
    batches = {r["latency_batch"] for r in rows if r.get("latency_batch")}
    return max(batches) if batches else None


def _with_note(artifact, note):
    """'teacher (PyTorch fp32)' + note -> 'teacher (PyTorch fp32; note)'."""
    return f"{artifact[:-1]}; {note})" if artifact.endswith(")") else f"{artifact} ({note})"


def _still_current(rel, entry, manifest, states):
    """The file `rel` that `entry`'s stage read is still the current output of a current stage."""
    owner = rel.split("/")[0]
    current = (manifest["stages"].get(owner) or {}).get("outputs", {}).get(rel)
    return entry.get("inputs", {}).get(rel) == current and states.get(owner, ("",))[0] == "complete"


def markdown_table(rows):
    big = latency_batch(rows)
    second = big != 1  # batch 1 alone timed (export.latency_batch_sizes: [1]): one latency column, not two alike
    lines = ["| artifact | params | size | val acc | latency b1 |"
             + (f" latency {f'b{big}' if big else 'largest batch'} |" if second else ""),
             "|---|---:|---:|---:|---:|" + ("---:|" if second else "")]
    for r in rows:
        name = r["artifact"] + ("" if r.get("current", True) else " *(stale)*") + (" **- deploy**" if r.get("ship")
                                                                                    else "")
        lines.append(f"| {name} | {_fmt_int(r['params'])} | {_fmt_size(r['size_bytes'])} | "
                     f"{_fmt(r['val_acc'], '{:.2f}%')} | {_fmt(r['latency_b1_ms'], '{:.3f} ms')} |"
                     + (f" {_fmt(r['latency_b64_ms'], '{:.2f} ms')} |" if second else ""))
    return "\n".join(lines)


def text_table(rows):
    """The rows as aligned text lines for a terminal (`compress show`): artifact, accuracy, size, latencies."""
    width = max([len(r["artifact"]) + (9 if r.get("ship") else 0) for r in rows] + [8])
    big = latency_batch(rows)
    second = big != 1  # as in markdown_table
    lines = [f"{'artifact':{width}}  {'val acc':>8} {'size':>9} {'b1':>10}"
             + (f" {f'b{big}' if big else 'b largest':>10}" if second else "")]
    for r in rows:
        name = r["artifact"] + (" - deploy" if r.get("ship") else "") + ("" if r.get("current", True) else " (stale)")
        lines.append(f"{name:{width}}  {_fmt(r['val_acc'], '{:.2f}%'):>8} {_fmt_size(r['size_bytes']):>9} "
                     f"{_fmt(r['latency_b1_ms'], '{:.3f} ms'):>10}"
                     + (f" {_fmt(r['latency_b64_ms'], '{:.2f} ms'):>10}" if second else ""))
    return lines


def _fmt(value, pattern):
    return "-" if value is None else pattern.format(value)


def _fmt_int(value):
    return "-" if value is None else f"{value:,}"


def _fmt_size(value):
    return "-" if value is None else size_text(value)


LATENCY_CAPTION = ("Latency: ms of a call per batch on the most threads measured - the files take turns in 5 "
                   "interleaved rounds (11 in a cell the verdict timed again), so a busy machine slows them alike, "
                   "and each round's fastest call counts, the median over the rounds (the teacher, its fp32 ONNX "
                   "export, is timed the same way on its own); `compress bench <run directory>` times the files this "
                   "way too.")


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
    # escaped like the terminal's lines: `cat report.md` must not act on a control character from a folder's
    # name or a message a file held
    atomic_write_text(run.path("report.md"), safe_text("\n".join(text)))
    return rows


def plot(rows, path):
    """Accuracy against size and against the largest batch's latency, as a PNG (headless matplotlib)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(rows)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def figure(rows):
    """The report's figure: accuracy against file size and against largest-batch latency, both on log axes with a
    labelled tick every 1-2-5 step (finer over a narrow range). Every artifact has its own marker and colour,
    named in one legend below the plots (labels beside points overlapped whenever two points were close); the
    file to deploy is ringed and named so; the teacher's latency is that of its fp32 ONNX export, and says so."""
    import matplotlib.pyplot as plt

    markers = "osD^vP*Xhp<>"
    # a point needs a finite accuracy and a finite, positive x on the log axis; a row with neither x is left out
    rows = [{**r, **{k: r[k] if plausible(r[k], *PLAUSIBLE[k]) and r[k] > 0 else None
                     for k in ("size_bytes", "latency_b64_ms")}} for r in rows if plausible(r["val_acc"], 0, 100)]
    rows = [r for r in rows if r["size_bytes"] is not None or r["latency_b64_ms"] is not None]  # drawn: in the legend
    style = {r["artifact"]: (f"C{i % 10}", markers[i % len(markers)]) for i, r in enumerate(rows)}
    big = latency_batch(rows)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, key, label in ((axes[0], "size_bytes", "file size (KB, log scale)"),
                           (axes[1], "latency_b64_ms", f"latency, {f'batch {big}' if big else 'largest batch'}, most "
                                                       "threads timed (ms, log scale)")):
        xs, ys = [], []
        for r in rows:
            if r[key] is None:
                continue
            x = r[key] / 1e3 if key == "size_bytes" else r[key]
            color, marker = style[r["artifact"]]
            ax.scatter(x, r["val_acc"], s=60, color=color, marker=marker, zorder=3, alpha=0.85,
                       edgecolors="black" if r.get("current", True) else "none")
            if r.get("ship"):
                ax.scatter(x, r["val_acc"], s=420, facecolors="none", edgecolors="crimson", linewidths=2, zorder=4)
                ax.annotate("deploy", (x, r["val_acc"]), textcoords="offset points", xytext=(0, 14), ha="center",
                            color="crimson", fontsize=9, fontweight="bold")
            xs.append(x)
            ys.append(r["val_acc"])
        if xs:
            ax.set_xscale("log")
            _log_ticks(ax.xaxis, min(xs) / 1.6, max(xs) * 1.6)
            spread = max(max(ys) - min(ys), 0.5)
            ax.set_ylim(min(ys) - spread * 0.2, max(ys) + spread * 0.3)
        ax.set_xlabel(label)
        ax.set_ylabel("validation accuracy (%)")
        ax.grid(True, alpha=0.3, which="both")
    axes[0].set_title("accuracy vs size")
    axes[1].set_title("accuracy vs latency (the teacher: its fp32 ONNX export)")
    handles = [plt.Line2D([], [], linestyle="", marker=m, color=c, markersize=8, markeredgecolor="black")
               for c, m in style.values()]
    names = [name + ("" if r.get("current", True) else " (stale)") + (" - the file to deploy" if r.get("ship") else "")
             for name, r in zip(style, rows)]
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08 + 0.025 * ((len(names) + 1) // 2), 1, 1))
    return fig


def _log_ticks(axis, low, high):
    """Set a log axis to [low, high] with labelled ticks at 1-2-5 steps over a wide range, more over a narrow
    one (matplotlib's default labels the powers of ten only: one label, or none, over a 10x range)."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    decades = math.log10(high / low)
    subs = (1.0, 2.0, 5.0) if decades > 1.5 else (1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if decades > 0.6 else \
        tuple(float(i) for i in range(1, 10))
    (axis.axes.set_xlim if axis.axis_name == "x" else axis.axes.set_ylim)(low, high)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 100 else f"{v:.3g}"))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(float(i) for i in range(1, 10))))
    axis.set_minor_formatter(NullFormatter())
