"""What the report says of distillation (compress.distill.report): when the distilled student reached the
student alone, and how to ship the student alone when it is the better one."""

from compress.distill.report import alone_better, epoch_passing
from stages.distill import report_notes


def test_the_report_says_when_the_distilled_student_reached_the_student_alone():
    history = [{"epoch": 1, "val_acc": 50.0}, {"epoch": 2, "val_acc": 71.0}, {"epoch": 3, "val_acc": 69.0},
               {"epoch": 4, "val_acc": 74.0}, {"epoch": 5, "val_acc": 74.5}]
    assert epoch_passing(history, 70.0) == 4  # not 2: epoch 3 fell back below
    assert epoch_passing(history, 68.0) == 2 and epoch_passing(history, 74.5) == 5
    assert epoch_passing(history, 75.0) is None
    m = {"kd_method": "standardized", "val_acc": 74.0, "baseline_val_acc": 70.0, "teacher_val_acc": 80.0,
         "gain_points": 4.0, "epochs": 4, "epoch_passing_alone": 2}
    assert ("From epoch 2 of 4 on (50% of the way through the same learning-rate schedule) it stayed at or above "
            "the student alone's final accuracy.") in report_notes({"metrics": m})[0]
    assert "only at its last epoch" in report_notes({"metrics": {**m, "epoch_passing_alone": 4}})[0]
    for quiet in ({"gain_points": -1.0}, {"epoch_passing_alone": None}, {"epoch_passing_alone": 0}):
        assert "reached the student alone" not in report_notes({"metrics": {**m, **quiet}})[0]
    old = {k: v for k, v in m.items() if k != "epoch_passing_alone"}  # a run from before this was measured
    assert "reached the student alone" not in report_notes({"metrics": old})[0]


def test_the_report_says_how_to_ship_the_student_alone_when_it_is_better_beyond_noise():
    m = {"kd_method": "standardized", "val_acc": 73.5, "baseline_val_acc": 75.69, "teacher_val_acc": 75.28,
         "gain_points": -2.19, "gain_p": 0.008, "val_images": 1966, "distilled_only_right": 80,
         "alone_only_right": 123}
    note = report_notes({"metrics": m})[0]
    assert note.startswith("Distillation (standardized-logit KD) lost 2.19 points: ")  # not "gained -2.19"
    assert note.endswith("The student trained alone is the better one: to quantize and ship it instead, compress run "
                         "--stages qat,export --set qat.source=baseline.")
    assert alone_better(m) == ("the student trained alone (75.69%) is better than the distilled one (73.50%) beyond "
                               "noise on these images (McNemar p = 0.008); to quantize and ship it instead, compress "
                               "run --stages qat,export --set qat.source=baseline (a stronger teacher is what would "
                               "make distilling pay)")
    # in the run's report the command names the run, and once the qat stage quantized the student alone, it says so
    note = report_notes({"metrics": m}, {"stages": {}}, "compress run --run-dir artifacts/mine")[0]
    assert note.endswith("compress run --run-dir artifacts/mine --stages qat,export --set qat.source=baseline.")
    qat = {"status": "complete", "config": {"qat": {"source": "baseline"}}}
    note = report_notes({"metrics": m}, {"stages": {"qat": qat}}, "compress run --run-dir artifacts/mine")[0]
    assert note.endswith("The student trained alone is the better one, and it is the one quantized and shipped "
                         "(qat.source).") and "--set qat.source" not in note
    for quiet in ({"gain_p": 0.2}, {"gain_points": 0.5, "gain_p": 0.01}):  # within noise, or distilling won
        assert "qat.source=baseline" not in report_notes({"metrics": {**m, **quiet}})[0]
    assert alone_better({k: v for k, v in m.items() if k != "gain_p"}) == ""  # a run from before McNemar
    one = report_notes({"metrics": {**m, "distilled_only_right": 1}})[0]
    assert "Of 1,966 validation images, 1 is right only with the distilled student" in one


def test_the_report_names_every_loss_that_used_the_teacher_and_says_when_the_students_answer_alike():
    """The gain is credited to the losses the run used (a hint-only run is not "standardized KD"), and two
    students right and wrong on the same images are said to answer alike, not to be "within noise"."""
    from compress.distill.report import losses_label

    m = {"kd_method": "hinton", "val_acc": 70.0, "baseline_val_acc": 70.0, "teacher_val_acc": 80.0,
         "gain_points": 0.0, "gain_p": 1.0, "val_images": 500, "distilled_only_right": 0, "alone_only_right": 0}
    assert losses_label({**m, "losses": ["ce", "kd", "cosine"]}) == "Hinton KD + cosine loss"
    assert losses_label({**m, "losses": ["ce", "hint"]}) == "FitNets hint"
    assert losses_label({**m, "losses": ["ce"]}) == "no loss using the teacher"
    assert losses_label(m) == "Hinton KD"  # a run recorded before its losses were
    note = report_notes({"metrics": {**m, "losses": ["ce", "hint"]}})[0]
    assert note.startswith("Distillation (FitNets hint) gained")
    assert "the two students answer every validation image alike" in note and "within noise" not in note


def test_the_gain_note_says_when_the_stage_was_resumed_on_another_number_of_processes():
    m = {"kd_method": "standardized", "val_acc": 74.0, "baseline_val_acc": 73.8, "teacher_val_acc": 80.0,
         "gain_points": 0.2, "epochs": 4}
    said = "The stage was resumed on another number of processes (2, then 1)"
    assert said in report_notes({"metrics": {**m, "world_sizes": [2, 1]}})[0]
    for quiet in ({}, {"world_sizes": [2]}, {"world_sizes": "2,1"}, {"world_sizes": [2, "1"]}):
        assert "resumed on another number" not in report_notes({"metrics": {**m, **quiet}})[0]
