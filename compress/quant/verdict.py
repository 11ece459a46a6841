"""The export verdict: which file to deploy - fp32, QAT int8 or PTQ int8 - weighed on accuracy (exact McNemar tests
image by image, compress.training.paired) and on latency (the report table's own cell: the largest batch on the most
threads timed - every core, or the most of export.latency_threads - in the first runtime), and named with its
reason in one sentence; then the words the stage's summary line and the run report say about the export.

The rule: of the two int8 files, the more accurate beyond noise; equally accurate, the QAT file unless the PTQ
file is at least FASTER times faster in every interleaved round; that int8 file is deployed when it is
export.min_int8_speedup times faster than fp32, else the fp32 file is."""

import re

from compress.cpus import usable_cpus
from compress.deploy.export_report import Attempt, Candidate, Speed, Verdict
from compress.deploy.latency import cell_ms, deciding_cell, remeasure
from compress.deploy.runtimes import label
from compress.deploy.timing import LONGER_ROUNDS, ROUNDS, fewer_threads, speedup_text, threads_text
from compress.fileio import size_text
from compress.training.paired import p_text

LABELS = {"fp32": "fp32", "int8": "QAT int8", "ptq": "PTQ int8"}
FASTER = 1.1  # one int8 file beats the other on speed only this much faster, in every round: less is noise
BUSY = 0.5  # cores other processes kept busy, from which the timings are called noisy
# after advice read from timings taken beside busy neighbours: fewer threads win there because the others are taken
BUSY_ADVICE = (" - measured while other processes kept CPUs busy, where fewer threads win because the others are "
               "taken: time it again on a quiet machine before acting on it")


def decide(measured, tables, paths, files, sizes, float_layers, e, runtime, stop=None):
    """(Speed, Verdict) from the deciding runtime's `tables`; when the int8 file falls short of
    export.min_int8_speedup its cell is measured once more, longer, in `tables` itself (the table keeps showing
    the figures the verdict read) and weighed again."""
    batch, threads = deciding_cell(tables["fp32"])
    attempts = []
    for rounds in (ROUNDS, LONGER_ROUNDS):
        if rounds == LONGER_ROUNDS:
            remeasure(tables, {k: paths[k] for k in files}, batch, threads, e.latency_repeats, e.latency_warmup,
                      stop, runtime)
        verdict, kind = weigh(measured, tables, files, sizes, float_layers, e, runtime)
        fp32_ms, int8_ms = cell_ms(tables["fp32"], batch, threads), cell_ms(tables[kind], batch, threads)
        attempts.append(Attempt(rounds, fp32_ms, int8_ms))
        if verdict.int8_faster:
            break
    speed = Speed(runtime, batch, threads, round(fp32_ms / int8_ms, 4), e.min_int8_speedup, fp32_ms, int8_ms,
                  attempts, files[kind])
    return speed, verdict


def weigh(measured, tables, files, sizes, float_layers, e, runtime):
    """(Verdict, the int8 kind weighed against fp32) from the accuracy figures `measured`
    (compress.quant.verify.measure_accuracy) and the latency cells `tables` ({kind: cells})."""
    batch, threads = deciding_cell(tables["fp32"])
    accuracy = {"fp32": measured["fp32"].onnx_acc, "int8": measured["int8"].onnx_acc}
    if measured["ptq"] is not None and "ptq" in files:
        accuracy["ptq"] = measured["ptq"].onnx_acc
    candidates = {k: Candidate(k, files[k], accuracy[k], cell_ms(tables[k], batch, threads), sizes[k])
                  for k in accuracy}
    kind, choice = _int8_choice(measured, tables, batch, threads) if "ptq" in candidates else ("int8", "")
    fp32, int8 = candidates["fp32"], candidates[kind]
    ratio, smaller = fp32.ms / int8.ms, fp32.size_bytes / int8.size_bytes
    timing = (f"batch {batch}, {threads_text(threads)} in {label(runtime)}: {int8.ms:.2f} ms against fp32's "
              f"{fp32.ms:.2f} ms")
    against = (f"{int8.accuracy:.2f}% validation accuracy against fp32's {fp32.accuracy:.2f}% "
               f"({_against_fp32(measured, kind)})")
    faster = ratio >= e.min_int8_speedup
    if faster and kind == "ptq" and choice:
        why = f"{choice}; it is {speedup_text(ratio)} than fp32 ({timing}) and {smaller:.1f}x smaller, at {against}"
    elif faster:
        why = (f"{LABELS[kind]} is {speedup_text(ratio)} than fp32 ({timing}) and {smaller:.1f}x smaller, at "
               f"{against}" + (f"; {choice}" if choice else ""))
    else:
        kept = f" even with {', '.join(float_layers)} kept in float" if float_layers else ""
        advice = ("to make int8 pay, keep more layers in float (qat.float_layers) or choose a student with more "
                  "channels per layer" if ratio < 1 else
                  f"int8 is faster, by less than the {e.min_int8_speedup:g}x export.min_int8_speedup asks: lower it "
                  "to deploy the int8 file")
        why = (f"{LABELS[kind]} is {speedup_text(ratio)} than fp32{kept} ({timing}; needed "
               f"{e.min_int8_speedup:g}x), so the fp32 file is {'the faster one' if ratio < 1 else 'the one'} to "
               f"deploy; the int8 file is still {smaller:.1f}x smaller, if size matters more than speed, at {against}; "
               f"{advice}" + (f"; of the two int8 files, {choice}" if choice else ""))
    ship = int8 if faster else fp32
    return Verdict("int8" if faster else "fp32", ship.file, runtime, faster, why, list(candidates.values())), kind


def _int8_choice(measured, tables, batch, threads):
    """(kind, the reason in words) of the int8 file weighed against fp32: QAT's ("int8") or PTQ's ("ptq")."""
    ptq = measured["ptq"]
    pair = ptq.vs_qat
    images = "validation image" + ("" if pair.only_second == 1 else "s")
    evidence = (f"{pair.only_second} {images} right only with PTQ, {pair.only_first} only with QAT, "
                f"McNemar p {p_text(pair.p)}")
    if not ptq.int8_kernels:
        return "int8", f"PTQ int8 runs no int8 kernel in onnxruntime, so QAT int8 is the int8 file ({evidence})"
    if pair.p < 0.05 and pair.only_second > pair.only_first:
        return "ptq", (f"PTQ int8 is more accurate than QAT int8 beyond noise ({evidence}: QAT cost accuracy here, "
                       "a lower qat.lr may let it keep it)")
    if pair.p < 0.05:
        return "int8", f"PTQ int8 is less accurate than QAT int8 beyond noise ({evidence})"
    qat_cell, ptq_cell = (next(c for c in tables[k] if (c["batch"], c["threads"]) == (batch, threads))
                          for k in ("int8", "ptq"))
    ratio = qat_cell["ms"] / ptq_cell["ms"]
    every_round = all(p * FASTER <= q for p, q in zip(ptq_cell.get("round_ms") or [], qat_cell.get("round_ms") or []))
    if ratio >= FASTER and every_round and ptq_cell.get("round_ms"):
        return "ptq", (f"PTQ int8 is as accurate as QAT int8 (within noise: {evidence}) and {ratio:.2f}x faster than "
                       "it, in every interleaved round")
    speed = (f"{speedup_text(ratio)} on the median but not {FASTER:g}x faster in every interleaved round"
             if ratio >= FASTER else f"not {FASTER:g}x faster than QAT int8 ({speedup_text(ratio)})")
    return "int8", f"PTQ int8 is as accurate (within noise: {evidence}) and {speed}, so QAT int8 is the int8 file"


def _against_fp32(measured, kind):
    """The int8 file against fp32 image by image, in words."""
    pair = (measured.get("pairs") or {}).get(f"fp32_vs_{kind}")
    if pair is None:
        return "not paired"
    if pair.p >= 0.05:
        return f"within noise, McNemar p {p_text(pair.p)}"
    told = (f"{pair.only_first} images right only with fp32, {pair.only_second} only with {LABELS[kind]}: beyond "
            f"noise, McNemar p {p_text(pair.p)}")
    return told + ("; deploy model.fp32.onnx instead if those images matter more than speed"
                   if pair.only_first > pair.only_second else "")


def manifest_metrics(report):
    """The export's figures recorded in the manifest (what `compress show` and the report's notes read)."""
    r, s, v = report, report.speed, report.verdict
    lat = {k: {f"b{c.batch}_t{c.threads}": c.ms for c in cells} for k, cells in r.latency_ms.items()}
    out = {"params": r.params, "fp32_onnx_acc": r.fp32.onnx_acc, "int8_onnx_acc": r.int8.onnx_acc,
           "fp32_bytes": r.size_bytes["fp32"], "int8_bytes": r.size_bytes["int8"], "size_ratio": r.size_ratio_int8_fp32,
           "fp32_max_abs_diff": r.fp32.max_abs_diff, "fp32_max_scaled_diff": r.fp32.max_scaled_diff,
           "fp32_top1_agreement": r.fp32.top1_agreement, "int8_top1_agreement": r.int8.top1_agreement,
           "int8_top1_within_tie": r.int8.top1_within_tie, "latency_ms": lat, "int8_speedup": s.speedup,
           "speed_runtime": s.runtime, "int8_weighed": s.int8_file, "runtimes": list(r.runtimes),
           "float_layers": r.float_layers, "deploy": v.file, "deploy_why": v.why,
           "verdict_cell": {"batch": s.batch, "threads": s.threads}}
    if r.cpus_busy_while_timing is not None:
        out["cpus_busy_while_timing"] = r.cpus_busy_while_timing
    for runtime, tables in list(r.runtimes.items())[1:]:  # the deciding runtime's figures are the table's
        threads = max(c.threads for c in tables["fp32"])
        cells = {k: next((c for c in tables.get(k, []) if (c.batch, c.threads) == (s.batch, threads)), None)
                 for k in ("fp32", "int8")}
        if None not in cells.values():
            out.setdefault("other_runtimes", {})[runtime] = {"batch": s.batch, "threads": threads,
                                                             **{k: c.ms for k, c in cells.items()},
                                                             **round_ratios(cells["fp32"], cells["int8"])}
    if r.ptq is not None:
        pair = r.ptq.vs_qat
        out.update(ptq_onnx_acc=r.ptq.onnx_acc, ptq_bytes=r.size_bytes["ptq"],
                   qat_minus_ptq_points=round(r.int8.onnx_acc - r.ptq.onnx_acc, 4), qat_only_right=pair.only_first,
                   ptq_only_right=pair.only_second, qat_vs_ptq_p=pair.p, val_images=r.int8.samples)
    return out


def round_ratios(fp32, int8):
    """{'round_ratios': [min, max]} of int8's speed-up over fp32 in each interleaved round of one latency cell
    (the files take turns within a round, so a round's pair saw the same machine), or {} without per-round figures."""
    pairs = list(zip(fp32.round_ms or [], int8.round_ms or []))
    ratios = [f / i for f, i in pairs if f and i]
    return {"round_ratios": [round(min(ratios), 3), round(max(ratios), 3)]} if len(ratios) >= 2 else {}


def _spread_note(t, runtime):
    """' Its rounds disagreed ...' when one runtime's interleaved rounds put int8 on both sides of fp32 or more
    than 25 % apart: one figure would mislead, so the note says how far and how to time again."""
    ratios = t.get("round_ratios")  # the manifest is a file a user can edit: anything else gives no note
    if not (isinstance(ratios, list) and len(ratios) == 2 and all(type(r) in (int, float) and r > 0 for r in ratios)):
        return ""
    low, high = ratios
    if not (low < 1 < high or high / low > 1.25):
        return ""
    return (f" Its rounds disagreed (int8 {speedup_text(low)} to {speedup_text(high)} in one round or another): "
            f"time the files again with `compress bench <run directory> --runtime {runtime}` on a quiet machine.")


def summary_line(report):
    """The stage's one line: accuracy and size of each file, the deciding cell, and the file to deploy."""
    r, s = report, report.speed
    weighed = f" ({s.int8_file})" if s.int8_file != "model.int8.onnx" else ""
    return (f"fp32 ONNX {r.fp32.onnx_acc:.2f}% {size_text(r.size_bytes['fp32'])}, "
            f"int8 ONNX {r.int8.onnx_acc:.2f}% {size_text(r.size_bytes['int8'])}"
            + (f", PTQ int8 {r.ptq.onnx_acc:.2f}%" if r.ptq is not None else "")
            + f"; {label(s.runtime)}, batch {s.batch}, {threads_text(s.threads)}: int8{weighed} {s.int8_ms:.2f} ms "
            f"vs fp32 {s.fp32_ms:.2f} ms ({speedup_text(s.speedup)}) - deploy {r.verdict.file}")


def near_chance(file, accuracy, classes):
    """A sentence when the file to deploy is hardly better than guessing - within a tenth of the way from chance
    to 100 %, as the distill stage judges its models - else ''."""
    chance = 100.0 / classes
    if accuracy is None or accuracy >= chance + (100.0 - chance) / 10:
        return ""
    return (f"the file to deploy, {file}, scores {accuracy:.2f}% on the validation images, hardly better than chance "
            f"({chance:.1f}% for {classes} classes): it is not worth deploying; the report's accuracy column shows "
            "where it was lost (train the teacher and the student longer: teacher.epochs, distill.epochs)")


def busy_note(busy, folder):
    """Said once - in the log once the timing is done, and in the report - when other processes kept cores busy."""
    return (f"other processes kept {busy:.1f} of this machine's {usable_cpus()} usable CPUs busy while the files "
            f"were timed, so the latency figures (the table and the int8-vs-fp32 verdict) are noisy; time the files "
            f"again on a quiet machine: compress bench {folder}/model.fp32.onnx {folder}/model.int8.onnx")


def report_notes(m):
    """The run report's sentences on the export, from its manifest metrics `m` (also those of earlier versions)."""
    notes = [f"Deploy export/{m['deploy']}: {m['deploy_why']}."]
    if m.get("near_chance"):
        notes.append(m["near_chance"][0].upper() + m["near_chance"][1:] + ".")
    notes += [
             "The fp32 ONNX file is the float student as the qat stage received it (before QAT); the int8 files are "
             "made from it - by QAT, and for comparison by post-training quantization."]
    if "verdict_cell" in m:
        cell = m["verdict_cell"]
        notes.append(f"The verdict reads the latency table's own cells (batch {cell['batch']}, "
                     f"{threads_text(cell['threads'])}, {label(m['speed_runtime'])}); `compress bench <run "
                     "directory>` times the files the same way.")
    for runtime, t in m.get("other_runtimes", {}).items():
        notes.append(f"In {label(runtime)} (batch {t['batch']}, {threads_text(t['threads'])}): int8 {t['int8']:.3f} ms "
                     f"against fp32 {t['fp32']:.3f} ms ({speedup_text(t['fp32'] / t['int8'])}); the verdict weighs "
                     f"{label(m['speed_runtime'])}'s timings." + _spread_note(t, runtime))
    notes.extend(fewer_threads_notes(m))
    if m.get("cpus_busy_while_timing", 0) >= BUSY:
        note = busy_note(m["cpus_busy_while_timing"], "<run directory>/export")
        notes.append(note[0].upper() + note[1:] + ".")
    if "ptq_onnx_acc" in m:
        notes.append(f"QAT against post-training quantization of the same float student (onnxruntime static PTQ, "
                     f"model.ptq.onnx): {m['int8_onnx_acc']:.2f}% vs {m['ptq_onnx_acc']:.2f}% "
                     f"({m['qat_minus_ptq_points']:+.2f} points from the qat stage){beyond_noise(m)}.")
        fp32 = m.get("fp32_onnx_acc")
        if isinstance(fp32, (int, float)) and m["qat_minus_ptq_points"] >= 3 and m["int8_onnx_acc"] - fp32 >= 3:
            notes.append(f"The QAT file is {m['int8_onnx_acc'] - fp32:.1f} points above the float student it started "
                         f"from ({fp32:.2f}%): that is its fine-tuning epochs training a model that had not "
                         "converged, not quantization - more epochs for that float model (in the stage qat.source "
                         "names) would give it, and PTQ, as much.")
    return notes


def fewer_threads_notes(m):
    """Where the deployed file ran faster on fewer threads than on the most measured (a small int8 model at batch
    1: too little work per layer to split), one sentence a batch size saying so and what to set."""
    deploy = m.get("deploy") if isinstance(m.get("deploy"), str) else ""
    kind = deploy.removeprefix("model.").removesuffix(".onnx")  # model.<kind>.onnx: the key of its latency cells
    tables = m.get("latency_ms") if isinstance(m.get("latency_ms"), dict) else {}
    cells = []
    for key, ms in (tables.get(kind) if isinstance(tables.get(kind), dict) else {}).items():  # "b<batch>_t<threads>"
        found = re.fullmatch(r"b(\d+)_t(\d+)", str(key))
        if found and isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0:  # else: a damaged figure
            cells.append({"batch": int(found[1]), "threads": int(found[2]), "ms": ms})
    return [f"At batch {batch}, export/{m['deploy']} ran faster on {threads_text(threads)} "
            f"({ms:.3f} ms) than on {most} ({most_ms:.3f} ms): too little work per layer to split; where it runs "
            f"batches of {batch}, give the runtime {threads_text(threads)} (onnxruntime: "
            "SessionOptions.intra_op_num_threads)" + (BUSY_ADVICE if m.get("cpus_busy_while_timing", 0) >= BUSY else "")
            + "." for batch, threads, ms, most, most_ms in fewer_threads(cells)]


def beyond_noise(m):
    """Whether QAT and PTQ differ by more than chance, from the images only one of them gets right."""
    if "qat_vs_ptq_p" not in m:  # an export from before this was measured
        return ""
    qat, ptq, p = m["qat_only_right"], m["ptq_only_right"], m["qat_vs_ptq_p"]
    told = (f"; of {m['val_images']:,} validation images, {qat} {'is' if qat == 1 else 'are'} right only with QAT "
            f"and {ptq} only with PTQ "
            f"(McNemar p {p_text(p)})")
    weighed = m.get("int8_weighed")
    if p >= 0.05:
        return told + ": within noise, so the two int8 files are equally accurate on this evidence" + (
            "; the verdict weighed model.ptq.onnx, the faster of the two" if weighed == "model.ptq.onnx" else "")
    if qat > ptq:
        return told + ": QAT is more accurate beyond noise"
    if weighed == "model.ptq.onnx":
        return (told + ": post-training quantization is more accurate beyond noise here, so model.ptq.onnx is the "
                "int8 file the verdict weighed against fp32, not the QAT file (a lower qat.lr may let QAT keep its "
                "accuracy)")
    if weighed is None:  # an export from before the verdict could weigh the PTQ file
        return (told + ": post-training quantization is more accurate beyond noise here; model.ptq.onnx is the "
                "int8 file to try first (its latency is in the table), or lower qat.lr")
    return (told + ": post-training quantization is more accurate beyond noise here, but onnxruntime runs no int8 "
            "kernel in model.ptq.onnx, so the verdict kept the QAT file; a lower qat.lr may let QAT keep its accuracy")
