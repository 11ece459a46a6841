"""Which file to deploy (compress.quant.verdict), weighed on figures given by hand: int8 against fp32, PTQ
against QAT, and the report's words on them."""



def _weighed(fp32=2.0, int8=1.0, ptq=None, fp32_vs_int8=(3, 2, 1.0), qat_vs_ptq=(2, 3, 1.0), ptq_kernels=True,
             float_layers=(), **config):
    """compress.quant.verdict.weigh on figures given by hand: latencies {kind: ms or (ms, [round ms...])} in the
    deciding cell (batch 64, 2 threads), pairs as (only_first, only_second, p)."""
    from compress.deploy.export_report import Paired, Parity, PostTraining
    from compress.quant.verdict import weigh
    from compress.run.config import ExportConfig

    def parity(acc):
        return Parity(0.0, 1.0, 0.0, 1.0, 1.0, 0.0, acc, acc, 400)

    def cells(ms):
        ms, rounds = ms if isinstance(ms, tuple) else (ms, [ms] * 5)
        return [{"batch": 1, "threads": 1, "ms": ms / 10}, {"batch": 64, "threads": 2, "ms": ms, "round_ms": rounds}]

    measured = {"fp32": parity(75.5), "int8": parity(75.25), "ptq": None,
                "pairs": {"fp32_vs_int8": Paired(*fp32_vs_int8), "fp32_vs_ptq": Paired(3, 3, 1.0)}}
    files, sizes = {"fp32": "model.fp32.onnx", "int8": "model.int8.onnx"}, {"fp32": 4_000_000, "int8": 1_000_000}
    tables = {"fp32": cells(fp32), "int8": cells(int8)}
    if ptq is not None:
        measured["ptq"] = PostTraining(75.5, Paired(*qat_vs_ptq), {"QLinearConv": 3} if ptq_kernels else {})
        files["ptq"], sizes["ptq"], tables["ptq"] = "model.ptq.onnx", 990_000, cells(ptq)
    return weigh(measured, tables, files, sizes, list(float_layers), ExportConfig(**config), "onnxruntime")


def test_the_verdict_names_the_file_to_deploy_and_says_why_in_one_sentence_with_the_figures():
    """int8 when it is min_int8_speedup times faster than fp32 in the table's deciding cell; else fp32, called the
    faster file only when int8 is really slower, with what int8 still offers (its size) and what to change."""
    fast, kind = _weighed(2.0, 1.0, min_int8_speedup=1.2)
    assert (fast.deploy, fast.file, fast.int8_faster, kind) == ("int8", "model.int8.onnx", True, "int8")
    assert fast.why == ("QAT int8 is 2.00x faster than fp32 (batch 64, 2 threads in onnxruntime: 1.00 ms against "
                        "fp32's 2.00 ms) and 4.0x smaller, at 75.25% validation accuracy against fp32's 75.50% (within "
                        "noise, McNemar p = 1)")
    assert [(c.kind, c.ms, c.size_bytes) for c in fast.candidates] == [("fp32", 2.0, 4_000_000),
                                                                        ("int8", 1.0, 1_000_000)]
    slow, _ = _weighed(1.0, 1.25, float_layers=["stem.0"])
    assert (slow.deploy, slow.file, slow.int8_faster) == ("fp32", "model.fp32.onnx", False)
    assert slow.why == ("QAT int8 is 1.25x slower than fp32 even with stem.0 kept in float (batch 64, 2 threads in "
                        "onnxruntime: 1.25 ms against fp32's 1.00 ms; needed 1x), so the fp32 file is the faster one "
                        "to deploy; the int8 file is still 4.0x smaller, if size matters more than speed, at 75.25% "
                        "validation accuracy against fp32's 75.50% (within noise, McNemar p = 1); to make int8 pay, "
                        "keep more layers in float (qat.float_layers) or choose a student with more channels per layer")
    short, _ = _weighed(1.1, 1.0, min_int8_speedup=1.2)
    assert short.deploy == "fp32" and short.why.startswith("QAT int8 is 1.10x faster than fp32 (batch 64, 2 threads "
                                                           "in onnxruntime: 1.00 ms against fp32's 1.10 ms; needed "
                                                           "1.2x), so the fp32 file is the one to deploy;")
    assert short.why.endswith("int8 is faster, by less than the 1.2x export.min_int8_speedup asks: lower it to "
                              "deploy the int8 file") and "to make int8 pay" not in short.why
    # int8 less accurate than fp32 beyond noise: said, with the way back to fp32
    lossy, _ = _weighed(2.0, 1.0, fp32_vs_int8=(40, 10, 0.0001))
    assert lossy.deploy == "int8" and ("(40 images right only with fp32, 10 only with QAT int8: beyond noise, McNemar "
                                       "p = 0.0001; deploy model.fp32.onnx instead if those images matter more than "
                                       "speed)") in lossy.why
    for v in (fast, slow, short, lossy):
        assert v.why.count(". ") == 0 and not v.why.endswith(".")  # one sentence: the report adds the full stop


def test_the_verdict_weighs_the_ptq_file_against_the_qat_file_on_accuracy_then_speed():
    """Of the two int8 files: the more accurate beyond noise; equally accurate, the PTQ file only when it is at
    least 1.1x faster in every interleaved round, and the verdict says so."""
    rounds = [0.80, 0.82, 0.79, 0.81, 0.80]
    faster, kind = _weighed(2.0, 1.0, ptq=(0.80, rounds))  # within noise (p = 1), 1.25x faster every round
    assert (faster.file, kind, faster.deploy) == ("model.ptq.onnx", "ptq", "int8")
    assert faster.why.startswith("PTQ int8 is as accurate as QAT int8 (within noise: 3 validation images right only "
                                 "with PTQ, 2 only with QAT, McNemar p = 1) and 1.25x faster than it, in every "
                                 "interleaved round; it is 2.50x faster than fp32 (batch 64, 2 threads in onnxruntime: "
                                 "0.80 ms against fp32's 2.00 ms)")
    assert [c.kind for c in faster.candidates] == ["fp32", "int8", "ptq"]
    once, kind = _weighed(2.0, 1.0, ptq=(0.80, [0.80, 0.80, 0.80, 0.80, 1.02]))  # one round says otherwise
    assert (once.file, kind) == ("model.int8.onnx", "int8")
    assert once.why.endswith("; PTQ int8 is as accurate (within noise: 3 validation images right only with PTQ, 2 "
                             "only with QAT, McNemar p = 1) and 1.25x faster on the median but not 1.1x faster in "
                             "every interleaved round, so QAT int8 is the int8 file")
    alike, kind = _weighed(2.0, 1.0, ptq=1.02)
    assert kind == "int8" and "and not 1.1x faster than QAT int8 (1.02x slower), so QAT int8 is" in alike.why
    better, kind = _weighed(2.0, 1.0, ptq=1.1, qat_vs_ptq=(2, 161, 2e-45))  # more accurate beyond noise, slower
    assert kind == "ptq" and better.why.startswith("PTQ int8 is more accurate than QAT int8 beyond noise (161 "
                                                   "validation images right only with PTQ, 2 only with QAT, McNemar "
                                                   "p < 0.0001: QAT cost accuracy here, a lower qat.lr may let it keep "
                                                   "it); it is 1.82x faster than fp32")
    worse, kind = _weighed(2.0, 1.0, ptq=(0.5, [0.5] * 5), qat_vs_ptq=(161, 2, 2e-45))  # faster, less accurate
    assert kind == "int8" and worse.why.endswith("; PTQ int8 is less accurate than QAT int8 beyond noise (2 validation "
                                                 "images right only with PTQ, 161 only with QAT, McNemar p < 0.0001)")
    no_kernels, kind = _weighed(2.0, 1.0, ptq=(0.5, [0.5] * 5), qat_vs_ptq=(2, 161, 2e-45), ptq_kernels=False)
    assert kind == "int8" and "PTQ int8 runs no int8 kernel in onnxruntime" in no_kernels.why
    slow, kind = _weighed(1.0, 1.25, ptq=1.3, min_int8_speedup=1.0)  # neither int8 file pays: fp32, both named
    assert slow.file == "model.fp32.onnx" and "; of the two int8 files, PTQ int8 is as accurate" in slow.why


def test_the_reports_words_on_qat_against_ptq_follow_what_the_verdict_weighed():
    from compress.quant.verdict import beyond_noise

    m = {"qat_only_right": 2, "ptq_only_right": 161, "qat_vs_ptq_p": 2e-45, "val_images": 500}
    assert "so model.ptq.onnx is the int8 file the verdict weighed" in beyond_noise({**m, "int8_weighed":
                                                                                      "model.ptq.onnx"})
    assert "runs no int8 kernel in model.ptq.onnx, so the verdict kept the QAT file" in beyond_noise(
        {**m, "int8_weighed": "model.int8.onnx"})
    assert "model.ptq.onnx is the int8 file to try first" in beyond_noise(m)  # an export from before
    noise = {**m, "qat_only_right": 2, "ptq_only_right": 3, "qat_vs_ptq_p": 1.0}
    assert beyond_noise({**noise, "int8_weighed": "model.ptq.onnx"}).endswith(
        "equally accurate on this evidence; the verdict weighed model.ptq.onnx, the faster of the two")
    one = beyond_noise({**noise, "qat_only_right": 1, "ptq_only_right": 1})
    assert "1 is right only with QAT and 1 only with PTQ" in one


def test_a_qat_gain_that_is_training_an_unconverged_student_is_called_that():
    """A 1-epoch student gains 10 points in QAT's epochs: the report must not read that as what QAT buys over
    PTQ, and says what it is; a converged one's few tenths get no such note."""
    from compress.quant.verdict import report_notes

    m = {"deploy": "model.int8.onnx", "deploy_why": "faster", "int8_onnx_acc": 39.73, "ptq_onnx_acc": 29.65,
         "fp32_onnx_acc": 29.09, "qat_minus_ptq_points": 10.08}
    assert ("The QAT file is 10.6 points above the float student it started from (29.09%): that is its fine-tuning "
            "epochs training a model that had not converged, not quantization") in " ".join(report_notes(m))
    converged = {**m, "int8_onnx_acc": 79.1, "ptq_onnx_acc": 79.0, "fp32_onnx_acc": 79.2, "qat_minus_ptq_points": 0.1}
    assert "had not converged" not in " ".join(report_notes(converged))


def test_a_file_to_deploy_hardly_better_than_chance_is_called_not_worth_deploying():
    from compress.quant.verdict import near_chance, report_notes

    said = near_chance("model.int8.onnx", 25.0, 4)
    assert said.startswith("the file to deploy, model.int8.onnx, scores 25.00% on the validation images, hardly "
                           "better than chance (25.0% for 4 classes): it is not worth deploying")
    assert near_chance("model.int8.onnx", 40.0, 4) == "" and near_chance("model.int8.onnx", 32.0, 4)  # 25 + 7.5
    m = {"deploy": "model.int8.onnx", "deploy_why": "faster", "near_chance": said}
    assert report_notes(m)[1] == "T" + said[1:] + "."


def test_the_report_says_when_the_deployed_file_runs_faster_on_fewer_threads():
    """A small int8 model at batch 1 can be faster on 1 thread than on 2; the report says so for the deployed file
    (and only where the gap is beyond the 10 % a busy machine moves a cell), naming what to set."""
    from compress.quant.verdict import fewer_threads_notes, report_notes

    lat = {"fp32": {"b1_t1": 0.41, "b64_t1": 17.9, "b1_t2": 0.32, "b64_t2": 12.7},
           "int8": {"b1_t1": 0.136, "b64_t1": 6.63, "b1_t2": 0.170, "b64_t2": 5.18}}
    m = {"deploy": "model.int8.onnx", "deploy_why": "faster", "latency_ms": lat}
    notes = fewer_threads_notes(m)
    assert notes == ["At batch 1, export/model.int8.onnx ran faster on 1 thread (0.136 ms) than on 2 (0.170 ms): "
                     "too little work per layer to split; where it runs batches of 1, give the runtime 1 thread "
                     "(onnxruntime: SessionOptions.intra_op_num_threads)."]
    assert notes[0] in report_notes(m)
    busy = fewer_threads_notes({**m, "cpus_busy_while_timing": 1.2})
    assert busy == [notes[0][:-1] + " - measured while other processes kept CPUs busy, where fewer threads win "
                    "because the others are taken: time it again on a quiet machine before acting on it."]
    assert fewer_threads_notes({**m, "deploy": "model.fp32.onnx"}) == []  # fp32 gains from the second thread
    within_noise = {**lat, "int8": {**lat["int8"], "b1_t1": 0.160}}
    assert fewer_threads_notes({**m, "latency_ms": within_noise}) == []
    assert fewer_threads_notes({"deploy": "model.int8.onnx"}) == []  # a manifest from before latency was recorded


def test_a_damaged_latency_figure_in_the_manifest_gives_no_threads_note_and_no_error():
    """The manifest is a file a user can edit or damage: a latency key or figure that is not what export writes is
    skipped, never an exception in `compress report` or `compress show`."""
    from compress.quant.verdict import fewer_threads_notes

    good = {"b1_t1": 0.136, "b1_t2": 0.170}
    for bad in ({"bogus": 1.0}, {"b1_t3": "fast"}, {"b1_t3": True}, {"b1_t3": None}, {"b1_t3": -1}):
        damaged = {**good, **bad}
        assert len(fewer_threads_notes({"deploy": "model.int8.onnx", "latency_ms": {"int8": damaged}})) == 1
    for m in ({"deploy": "model.int8.onnx", "latency_ms": {"int8": [1, 2]}}, {"deploy": 3, "latency_ms": {}},
              {"deploy": "model.int8.onnx", "latency_ms": "fast"}):
        assert fewer_threads_notes(m) == []


def test_another_runtimes_line_says_when_its_interleaved_rounds_disagree():
    """A second runtime's int8-vs-fp32 line is one figure from a few interleaved rounds; where those rounds put int8
    on both sides of fp32 (or over 25 % apart) the report says so and how to time again, instead of one figure."""
    from compress.deploy.export_report import LatencyCell
    from compress.quant.verdict import report_notes, round_ratios

    def cell(rounds):
        return LatencyCell(64, 2, sorted(rounds)[len(rounds) // 2], 1.0, round_ms=rounds)

    steady = round_ratios(cell([3.7, 3.8, 3.9]), cell([2.0, 2.1, 2.0]))
    assert steady == {"round_ratios": [1.81, 1.95]}
    split = round_ratios(cell([9.2, 3.9, 11.5]), cell([6.8, 4.0, 9.1]))  # 1.35x, 0.98x, 1.26x
    assert split == {"round_ratios": [0.975, 1.353]}
    assert round_ratios(cell([3.7]), cell([2.0])) == {}
    assert round_ratios(LatencyCell(64, 2, 3.7, 1.0), cell([1, 2])) == {}
    m = {"deploy": "model.int8.onnx", "deploy_why": "faster", "speed_runtime": "onnxruntime"}
    line = {"batch": 64, "threads": 2, "fp32": 3.72, "int8": 3.84}
    quiet = [n for n in report_notes({**m, "other_runtimes": {"openvino": {**line, **steady}}}) if "OpenVINO" in n]
    assert quiet and "disagreed" not in quiet[0]
    noisy = [n for n in report_notes({**m, "other_runtimes": {"openvino": {**line, **split}}}) if "OpenVINO" in n]
    assert noisy[0].endswith("Its rounds disagreed (int8 1.03x slower to 1.35x faster in one round or another): time "
                             "the files again with `compress bench <run directory> --runtime openvino` on a quiet "
                             "machine."), noisy
    for damaged in ("x", [0, 2], [1.0], [True, 2.0]):
        notes = report_notes({**m, "other_runtimes": {"openvino": {**line, "round_ratios": damaged}}})
        assert not any("disagreed" in n for n in notes), damaged
