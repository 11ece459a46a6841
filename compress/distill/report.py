"""What distilling gained, in numbers and words: the distilled student against the student trained alone,
image by image on the validation images (McNemar), and from which epoch of the same schedule it stayed as good
as the student alone ended - the figures the distill stage records and the sentences the run report prints."""

import math

import torch

from compress.distill.feature_losses import FEATURE_LOSSES
from compress.distill.logit_losses import LOGIT_LOSSES
from compress.training import distributed as dist
from compress.training.paired import mcnemar_p, p_text


@torch.no_grad()
def paired_students(env, val, distilled, alone):
    """Each (model, precision) pair on this rank's share of the validation images, counts summed over ranks:
    {"val_images", "distilled_only_right", "alone_only_right", "gain_p"}."""
    counts = torch.zeros(3, dtype=torch.float64)  # right only distilled, right only alone, images
    for batch in val:
        y = batch.y.to(env.device)
        right = []
        for model, precision in (distilled, alone):
            model.eval()
            with precision.autocast():
                right.append(model(precision.inputs(batch.x, env.device)).float().argmax(1) == y)
        first, second = right
        counts += torch.tensor([(first & ~second).sum().item(), (second & ~first).sum().item(), len(y)],
                               dtype=torch.float64)
    only_first, only_second, images = (int(v) for v in dist.all_reduce(env, counts).tolist())
    return {"val_images": images, "distilled_only_right": only_first, "alone_only_right": only_second,
            "gain_p": mcnemar_p(only_first, only_second)}


def teacher_below_alone(teacher_acc, alone_acc, images):
    """The warning when the teacher scored below the student trained alone on the `images` validation images, with
    the gap in images and as a likelihood (the report's paired test decides what is noise), else ''."""
    if teacher_acc >= alone_acc:
        return ""
    apart = round((alone_acc - teacher_acc) * images / 100)
    return (f"the teacher ({teacher_acc:.2f}%) scored below the student trained alone ({alone_acc:.2f}%, {apart} "
            "validation image(s) more right): it may have less to teach than the labels; a stronger teacher (more "
            "teacher.epochs, a larger model.teacher) is likely to help more than any distillation setting")


def epoch_passing(history, accuracy):
    """The epoch (1-based) from which the validation accuracy stays at or above `accuracy` to the end, or None:
    not the first crossing, which a noisy epoch can make early."""
    passing = None
    for h in history:
        if h["val_acc"] < accuracy:
            passing = None
        elif passing is None:
            passing = h["epoch"]
    return passing


def mixed_processes_note(m):
    """A sentence when the stage was resumed on another number of processes (its metrics' `world_sizes`), else ''."""
    worlds = m.get("world_sizes")
    if not (isinstance(worlds, list) and len(worlds) > 1 and all(type(w) is int for w in worlds)):
        return ""
    return (f" The stage was resumed on another number of processes ({', then '.join(map(str, worlds))}): the "
            "students saw the same images in the same order, but sums over other processes round otherwise and the "
            "results drift as with another seed, so a gap within noise may be that alone.")


def gain_notes(m, method, refresh="compress run", alone_shipped=False):
    """The report's sentences on what distilling gained, from the distill stage's metrics `m` ([] without a
    student alone); `method` is the logit loss's label."""
    if "baseline_val_acc" not in m:
        return []
    extra, same = "", "same initialisation, schedule, seed and augmented views"
    if m.get("unlabelled_images"):
        ratio = (m["labelled_images"] + m["unlabelled_images"]) / m["labelled_images"]
        same = "same initialisation, seed, augmented views and number of epochs"
        extra = (f" The distilled student also learned from {m['unlabelled_images']:,} unlabelled images through the "
                 f"teacher; the student trained alone saw only the {m['labelled_images']:,} labelled ones, so each of "
                 f"its epochs was {ratio:.1f}x fewer optimizer steps: part of the gain is that extra training. The "
                 f"student alone trained for {math.ceil(m['epochs'] * ratio)} epochs would take as many steps; "
                 f"compare with it before crediting the teacher with all of the gain.")
    if m.get("mix", "none") != "none":  # the same augmentation for both, but mixing can handicap the one alone
        extra += (f" Both students trained on {m['mix']}-mixed images, which can cost a student trained alone points "
                  f"of its own: the student alone of a run with distill.mix=none is the one to beat.")
    extra += mixed_processes_note(m)
    moved = f"gained {m['gain_points']:.2f}" if m["gain_points"] >= 0 else f"lost {-m['gain_points']:.2f}"
    return [f"Distillation ({method}) {moved} points: the distilled student reaches "
            f"{m['val_acc']:.2f}%, the same student trained alone ({same}) {m['baseline_val_acc']:.2f}%; the teacher "
            f"{m['teacher_val_acc']:.2f}%.{_noise(m)}{'' if m.get('unlabelled_images') else _time_gain(m)}{extra}"
            + (_alone_wins_note(refresh, alone_shipped) if _alone_wins(m) else "")]


def _alone_wins_note(refresh, shipped):
    if shipped:
        return " The student trained alone is the better one, and it is the one quantized and shipped (qat.source)."
    return f" The student trained alone is the better one: {ship_alone(refresh)}."


def ship_alone(refresh):
    """The advice that quantizes and ships the student trained alone; `refresh` names the run
    (`compress run --run-dir DIR`) so the command works pasted as it is."""
    return f"to quantize and ship it instead, {refresh} --stages qat,export --set qat.source=baseline"


def alone_better(m, refresh="compress run"):
    """One sentence when the student trained alone beats the distilled one beyond noise on the validation images
    ('' otherwise): QAT and export then start from the weaker student unless told otherwise."""
    if not _alone_wins(m):
        return ""
    return (f"the student trained alone ({m['baseline_val_acc']:.2f}%) is better than the distilled one "
            f"({m['val_acc']:.2f}%) beyond noise on these images (McNemar p {p_text(m['gain_p'])}); "
            f"{ship_alone(refresh)} (a stronger teacher is what would make distilling pay)")


def _alone_wins(m):
    """Whether the student alone beat the distilled one beyond noise (McNemar p < 0.05) on the validation images."""
    return m.get("gain_p") is not None and m["gain_p"] < 0.05 and m.get("gain_points", 0) < 0


def _noise(m):
    """Whether the two students differ beyond chance on these validation images (not across seeds)."""
    if "gain_p" not in m:  # a run recorded before this was measured
        return ""
    only = m["distilled_only_right"]
    told = (f" Of {m['val_images']:,} validation images, {only:,} {'is' if only == 1 else 'are'} right only with the "
            f"distilled student and {m['alone_only_right']:,} only with the student alone (McNemar p "
            f"{p_text(m['gain_p'])})")
    if only == 0 and m["alone_only_right"] == 0:
        return told + ": the two students answer every validation image alike (no loss that used the teacher moved " \
                      "the distilled one, or they learned the same thing)."
    if m["gain_p"] < 0.05:
        return told + ": a difference beyond noise on these images (another seed still moves each student a little)."
    return (told + ": within noise - these images cannot tell the two apart; more validation images, or runs with "
            "other seeds, would.")


def _time_gain(m):
    """From which epoch on the distilled student stayed at or above the student alone's final accuracy."""
    epoch, epochs = m.get("epoch_passing_alone"), m.get("epochs")
    if not epoch or not epochs or m["gain_points"] <= 0:
        return ""
    if epoch == epochs:
        return " It reached the student alone's final accuracy only at its last epoch."
    return (f" From epoch {epoch} of {epochs} on ({epoch / epochs:.0%} of the way through the same learning-rate "
            f"schedule) it stayed at or above the student alone's final accuracy.")


def losses_label(m):
    """The losses that used the teacher, as the report names them ('Hinton KD + cosine loss'); the logit loss
    alone for a run recorded before its losses were."""
    logit = LOGIT_LOSSES.get(m.get("kd_method"))
    if not isinstance(m.get("losses"), list):
        return logit.label if logit else "distillation"
    used = [logit.label if term == "kd" and logit else FEATURE_LOSSES[term].label
            for term in m["losses"] if term == "kd" or term in FEATURE_LOSSES]
    return " + ".join(used) or "no loss using the teacher"
