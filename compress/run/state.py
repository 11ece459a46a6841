"""What each stage of a run must do, decided once, in one place, and handed to the stage as a frozen value.

`decide` gives a StageState: skip (complete, nothing it depends on changed), fresh (new, --force, or something
changed - and what), or resume from checkpoint X at epoch E, step S (interrupted with the same config and
inputs). It is the only code that reads resume checkpoints' metadata and checks their tensors (`read_resume`);
`compress show` asks it too. `stage_states` says where every stage of a run directory stands: complete (and
current), invalidated, a failed or interrupted run, or not run. A complete stage is current only while every
file it read is still what its upstream stage last wrote *and* that upstream stage is itself current: retraining
the teacher makes distill, qat and export stale.
"""

import dataclasses
import json
import logging
import os
from typing import Optional

from compress.errors import CompressError, InputError
from compress.fileio import sha256_file
from compress.run.config import JUDGES_RESULT, ConfigView, as_it_counts, config_slice, result_hash, section_hash
from compress.run.contract import (
    CODE_DIGEST,
    DIGESTS,
    EXTERNAL,
    IMAGE_BYTES_DIGEST,
    IMAGES_DIGEST,
    Code,
    File,
    Images,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where one part of a stage (its main model "", or the distill stage's "baseline") continues from."""

    path: str  # run-relative path of the resume checkpoint
    epoch: int
    step: int
    world_size: Optional[int] = None
    extra: dict = dataclasses.field(default_factory=dict)  # what the stage kept with it (QAT's float layers)


@dataclasses.dataclass(frozen=True)
class StageState:
    """What to do with one stage, why, and what it was decided from (JSON-able: rank 0 decides, every rank gets
    the same value)."""

    stage: str
    action: str  # "skip" | "fresh" | "resume"
    reason: str  # why, as a plan states it: "not run yet", "--force", "config changed (teacher.epochs)"
    config_hash: str
    config: dict  # the stage's slice of the config
    inputs: dict  # run-relative path (or external:<path>) -> sha256 of every file the stage reads
    sources: dict  # "stage:output" -> run-relative path of each declared input present
    resume: dict = dataclasses.field(default_factory=dict)  # part -> Resume (only when action == "resume")
    announce: str = ""  # the live log's line when the stage starts, where it differs from `reason`
    result_hash: str = ""  # `config.result_hash`: the config as far as it changes the result

    @property
    def headline(self):
        """What the live log says as the stage starts ("running again: config changed (qat.lr)")."""
        return self.announce or self.reason

    def resume_of(self, part=""):
        return self.resume.get(part)

    def to_json(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data):
        return cls(**{**data, "resume": {k: Resume(**v) for k, v in data["resume"].items()}})


def checkpoint_rel(stage, part=""):
    return "/".join([stage, *([part] if part else []), "last", "checkpoint.safetensors"])


def read_resume(run, stage, part="", epochs=None):
    """(Resume, None) for a readable, well-formed resume checkpoint of `stage` (or its `part`); (None, why not)
    otherwise, why being '' when there is none. Well-formed covers its tensors too: names, dtypes and shapes as
    written (its recorded layout) and every value finite - one whose tensors were edited, or that holds NaN or
    infinite values, starts the stage over like one with damaged metadata. Its config hash and inputs come back
    in Resume.extra's "_made_with" for the caller to compare."""
    rel = checkpoint_rel(stage, part)
    path = run.path(rel)
    if not os.path.isfile(path):
        return None, ""
    from compress.training.checkpoint import (  # torch: only when there is one
        read_metadata,
        resume_state_problem,
        resume_tensors_problem,
    )

    try:
        meta = read_metadata(path)
    except CompressError as e:  # its advice (delete it, or --force) is what happens anyway: it starts over
        return None, f"the resume checkpoint is unreadable ({str(e).split('; delete it')[0]})"
    state = meta.get("state")
    problem = resume_state_problem(state, epochs)
    if problem and resume_state_problem(state, None) is None:  # sound, but of a longer schedule than asked now
        return None, (f"the resume checkpoint is of an earlier run that got to epoch {state['epoch']}, past the "
                      f"{epochs} epochs asked now")
    if problem:
        return None, f"the resume checkpoint is damaged ({problem})"
    problem = resume_tensors_problem(path, meta.get("layout"))
    if problem:
        return None, f"the resume checkpoint ({rel}) {problem}"
    made_with = {"config_hash": state.get("config_hash"), "inputs": state.get("inputs", {}),
                 "result_hash": state.get("result_hash")}
    extra = dict(state.get("extra") or {}, _made_with=made_with)
    return Resume(rel, state["epoch"], state["step"], state.get("world_size"), extra), None


def decide(run, cfg, spec, force, stages, world, planning=False, running_first=()):
    """The StageState of stage module `spec` in run directory `run` for config `cfg` on `world` processes
    (`planning`: for a dry run, where weights not downloaded yet count as changed instead of unreadable, and the
    stages `running_first` run before this one, so their stale outputs are about to be replaced, not read)."""
    manifest = run.manifest()
    entries = manifest["stages"]
    states = stage_states(run, stages, manifest)
    inputs, sources = _inputs(run, cfg, spec, entries, states, stages, planning, running_first)
    base = {"stage": spec.NAME, "config_hash": section_hash(cfg, spec.CONFIG_KEYS),
            "config": config_slice(cfg, spec.CONFIG_KEYS), "inputs": inputs, "sources": sources,
            "result_hash": result_hash(cfg, spec.CONFIG_KEYS, _images_followed(inputs))}
    entry = entries.get(spec.NAME)
    if force:
        return StageState(action="fresh", reason="--force", announce="running (--force)", **base)
    if entry and entry.get("status") == "complete":
        return _completed(run, cfg, spec, entry, base, world)
    epochs = getattr(getattr(cfg, spec.NAME, None), "epochs", None)
    main, problem = read_resume(run, spec.NAME, "", epochs)
    if main is None:
        if problem:
            return StageState(action="fresh", reason=f"{problem}; starting over", **base)
        last = _last_run(entry)
        if last:  # a stage that trains writes checkpoints; export and an untrained teacher (epochs 0) write none
            last += " before its first checkpoint" if epochs else ""
            return StageState(action="fresh", reason=f"{last}; starting over", announce=f"running again: {last}",
                              **base)
        return StageState(action="fresh", reason="not run yet", announce="running", **base)
    made_with = main.extra["_made_with"]
    if not _made_alike(made_with, base):
        otherwise = _made_otherwise(made_with, base, entry)
        return StageState(action="fresh", reason=f"its resume checkpoint ({checkpoint_rel(spec.NAME)}) was written by "
                                                 f"an earlier run with {otherwise}; starting over", **base)
    resume = {"": _same_world(main, world)}
    for part in getattr(spec, "PARTS", ())[1:]:
        other, _ = read_resume(run, spec.NAME, part, epochs)
        if other is not None and _made_alike(other.extra["_made_with"], base):  # not ==: a part resumed under a
            # result-irrelevant change (or by the next version) records another config hash than the main part
            resume[part] = _same_world(other, world)
    return StageState(action="resume", reason=_resume_reason(entry, resume, epochs, _judged_anew(entry, base)),
                      resume=resume, **base)


def _completed(run, cfg, spec, entry, base, world):
    """The StageState of a stage that completed: skipped when nothing it depends on changed; run again when
    something did; judged again from its checkpoint when only a key that judges its result (JUDGES_RESULT) changed
    and its result fails the new value."""
    modified = _modified_inputs(run, base["inputs"])  # an input replaced by hand is not up to date
    changed = f"its input {modified[0]} was modified after it was written" if modified else _changes(run, entry, base)
    if changed:
        return StageState(action="fresh", reason=changed, announce=f"running again: {changed}", **base)
    judged = _judged_anew(entry, base)
    if not judged:
        return StageState(action="skip", reason="same config and inputs", **base)
    failing = _fails_now(spec.NAME, entry, cfg)
    if not failing:
        return StageState(action="skip", reason=f"same config and inputs; its result passes {judged} too", **base)
    epochs = getattr(getattr(cfg, spec.NAME, None), "epochs", None)
    main, _ = read_resume(run, spec.NAME, "", epochs)
    if main is not None and _made_alike(main.extra["_made_with"], base) and epochs is not None \
            and main.epoch >= epochs:
        why = f"{failing}: judging its model again from its checkpoint after its last epoch"
        return StageState(action="resume", reason=why, announce=f"running again: {why}",
                          resume={"": _same_world(main, world)}, **base)
    why = f"{failing}: training it again (its checkpoint is gone)"
    return StageState(action="fresh", reason=why, announce=f"running again: {why}", **base)


def _judged_anew(entry, base):
    """'qat.max_accuracy_drop 3 (was 1)' for the keys that only judge the result (JUDGES_RESULT) and differ between
    the stage's last run (its manifest entry) and this decision, or ''."""
    old, new = (entry or {}).get("config"), base.get("config") or {}
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ""
    def value(picked, name, key):  # a config slice holds a key in its section, or as a dotted key of its own
        section = picked.get(name)
        return section.get(key) if isinstance(section, dict) else picked.get(f"{name}.{key}")

    changed = []
    for name, keys in JUDGES_RESULT.items():
        for key in keys:
            then, now = value(old, name, key), value(new, name, key)
            if then != now and then is not None:
                changed.append(f"{name}.{key} {now} (was {then})")
    return ", ".join(changed)


def _fails_now(stage, entry, cfg):
    """'its accuracy_drop 2.5 is over qat.max_accuracy_drop 0.5' when a completed stage's recorded metric fails a
    judging key's value now (JUDGES_RESULT), or ''."""
    metrics = entry.get("metrics") if isinstance(entry.get("metrics"), dict) else {}
    for key, metric in JUDGES_RESULT.get(stage, {}).items():
        value, bound = metrics.get(metric), getattr(getattr(cfg, stage, None), key, None)
        if isinstance(value, (int, float)) and isinstance(bound, (int, float)) and value > bound:
            return f"its {metric} {value:g} is over {stage}.{key} {bound:g}"
    return ""


def _made_alike(made_with, base):
    """Whether a resume checkpoint's config and inputs are this decision's (as far as the result goes)."""
    return _same_config(made_with, base) and made_with["inputs"] == _as_recorded(base["inputs"], made_with["inputs"])


def _same_config(recorded, base):
    """Whether a stage recorded (manifest entry or checkpoint) with `recorded`'s config would give the result `base`'s
    does: the same config, or one that differs only where the result cannot (`config.result_hash`: data.cache_mb,
    the same folder spelled another way...). A manifest entry also carries its config slice, compared as it counts
    today (`as_it_counts`): a rule added since (a path saved absolute now, a key no longer counted) does not make a
    stage an earlier version finished run again. A record without either (an older version's) must match exactly."""
    if recorded.get("config_hash") == base["config_hash"] or bool(
            recorded.get("result_hash") and recorded["result_hash"] == base.get("result_hash")):
        return True
    old, new = recorded.get("config"), base.get("config")
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return False
    followed = _images_followed(base.get("inputs", {}))
    try:
        return _canonical(as_it_counts(old, followed)) == _canonical(as_it_counts(new, followed))
    except (TypeError, ValueError, AttributeError, KeyError):  # a manifest edited by hand: the config changed
        return False


def _canonical(picked):
    return json.dumps(picked, sort_keys=True, allow_nan=False, default=str)


def _as_recorded(inputs, recorded):
    """`inputs` without the digests (images, model code) that `recorded` - written by a version that did not
    follow them - lacks: upgrading must not discard a checkpoint, nor rerun a finished stage, for them."""
    return {k: v for k, v in inputs.items() if k in recorded or not k.startswith(DIGESTS)}


def _made_otherwise(made_with, base, entry=None):
    """What differs between a checkpoint's config and inputs and this run's: 'another config' or 'other inputs
    (... changed since)'."""
    if not _same_config(made_with, base):
        # the checkpoint holds its config's hash; the manifest entry of the run that wrote it, the config itself
        recorded = entry.get("config") if entry and entry.get("config_hash") == made_with.get("config_hash") else None
        keys = _keys_that_count(recorded, base["config"], _images_followed(base["inputs"])) \
            if isinstance(recorded, dict) and isinstance(base.get("config"), dict) else []
        return f"another config ({', '.join(keys[:4])})" if keys else "another config"
    old, new = made_with.get("inputs") or {}, base["inputs"]
    new = _as_recorded(new, old)
    changed = [k.removeprefix(EXTERNAL) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return f"other inputs ({', '.join(changed)} changed since)"


def _last_run(entry):
    """'the last run failed (why)' / 'the last run was interrupted' for an unfinished entry, else ''."""
    status = (entry or {}).get("status")
    if status == "failed":
        return f"the last run failed ({(entry.get('message') or '').split(';')[0]})"
    if status in UNFINISHED:
        return f"the last run {UNFINISHED[status]}"
    return ""


def _same_world(point, world):
    """A checkpoint written by another number of processes resumes where it stopped: each global batch is dealt
    out over the processes (compress.data.sampling.EpochBatches), so step k covers the same images whatever the
    split - only the order the processes' sums are added in changes, and with it the last bits. The reason says
    so: such a resume is not bit-identical to a run that was never stopped."""
    if point.world_size not in (None, world):
        return dataclasses.replace(point, extra={**point.extra, "written_by_world": point.world_size,
                                                 "resumed_by_world": world})
    return point


def _resume_reason(entry, resume, epochs, judged_anew=""):
    """Where the stage resumes, in words: `resume` holds its main part's point ('') and those of its other parts
    (the distill stage's student alone, 'baseline') that resume too."""
    point = resume[""]
    done = epochs is not None and point.epoch >= epochs
    where = "after its last epoch" if done else f"at epoch {point.epoch + 1}, step {point.step}"
    later = [(part, p) for part, p in resume.items() if part and not (epochs is not None and p.epoch >= epochs)]
    if done and later:  # the main model trained; another part stopped midway
        where += "; " + ", ".join(f"its {part} part at epoch {p.epoch + 1}, step {p.step}" for part, p in later)
    if "written_by_world" in point.extra:
        then, now = point.extra["written_by_world"], point.extra["resumed_by_world"]
        where += (f" (written by {then} process{'es' if then != 1 else ''}, resumed by {now}: the same images in the "
                  "same order, the result not bit-identical to a run that was never stopped)")
    if entry and entry.get("status") == "failed" and judged_anew and done and not later:
        return f"{_last_run(entry)}; continuing from its checkpoint {where} to judge its model by {judged_anew}"
    if entry and entry.get("status") == "failed":
        return (f"{_last_run(entry)}; continuing from its checkpoint {where} with the same config - change the "
                "setting the message names to get another result")
    return f"resuming the interrupted run {where}"


NOT_FETCHED = "0" * 64  # the digest a dry run gives weights a real run would download first: matches no file


def _inputs(run, cfg, spec, entries, states, stages, planning=False, running_first=()):
    """({input key: sha256}, {"stage:output": run-relative path}) of the files the stage declares it reads."""
    inputs, sources = {}, {}
    for item in spec.inputs(ConfigView(cfg, spec.CONFIG_KEYS)):
        if isinstance(item, File):  # outside the run directory (pretrained weights)
            if planning and not os.path.lexists(os.path.expanduser(item.path)):
                inputs[item.input_key] = _to_be_fetched(item, entries.get(spec.NAME) or {})
            else:
                inputs[item.input_key] = _external_sha256(item)
            continue
        if isinstance(item, (Images, Code)):  # what data.root lists (images added, moved, renamed); a model's code
            for key, digest in _digests(cfg, item):
                if digest:
                    inputs[key] = digest
            continue
        rel, present = _upstream_output(run, entries, stages, item)
        entry = entries.get(item.stage) or {}
        if not item.required and not (present and states[item.stage][0] == "complete"):
            continue
        if not item.required and files_changed(run, entry["outputs"], [rel]):  # else it reruns every time
            log.warning("%s: leaving out %s (optional): it was modified after the %s stage wrote it; restore it, "
                        "or run the %s stage again, to use it", spec.NAME, rel, item.stage, item.stage)
            continue
        if not present:
            raise InputError(_missing_message(run, entries, item, rel))
        if states[item.stage][0] != "complete" and item.stage not in running_first:
            log.warning("%s: reading %s from the %s stage, which is stale (%s)", spec.NAME, rel, item.stage,
                        states[item.stage][1])
        inputs[rel] = entry["outputs"][rel]  # what the stage verifies the file against when it loads it
        sources[f"{item.stage}:{item.output}"] = rel
    return inputs, sources


def _digests(cfg, item):
    """[(input key, digest)] that stand for an Images input (its listing, then its bytes) or a Code input (''
    where there is nothing of the user's to follow)."""
    if isinstance(item, Images):
        from compress.data.imagefolder import bytes_digest, listing_digest  # only here: they scan the folder

        listing = listing_digest(cfg.data, item.key)
        return [(item.input_key, listing), (item.bytes_key, listing and bytes_digest(cfg.data, item.key))]
    from compress.models.registry import source_of

    name = getattr(cfg.model, item.key.split(".")[1])
    return [(item.input_key, source_of(name).digest(name))]


def _modified_inputs(run, inputs):
    """The run-directory inputs whose bytes are no longer what their stage recorded (replaced or damaged since)."""
    return files_changed(run, inputs, [rel for rel in inputs if not rel.startswith(EXTERNAL)])


def files_changed(run, recorded, rels):
    """Those of `rels` (run-relative) that `recorded` ({path: sha256}) holds and whose file is gone or no longer
    has the recorded bytes: a file replaced, damaged or removed by hand since its stage wrote it."""
    return [rel for rel in dict.fromkeys(rels) if rel in recorded and (
        not os.path.isfile(run.path(rel)) or sha256_file(run.path(rel)) != recorded[rel])]


def missing_upstream(run, cfg, stage_names, stages):
    """The required inputs of the first requested stage that neither the run directory holds nor an earlier stage
    of this run writes, in one sentence; '' when every stage will find its inputs. Asked before anything is written,
    so `--stages teacher,export` in a new run directory stops now, not after the teacher has trained."""
    from compress.run.contract import Input

    entries = run.manifest()["stages"]
    for name in stage_names:
        spec = stages[name]
        missing = []
        for item in spec.inputs(ConfigView(cfg, spec.CONFIG_KEYS)):
            if not isinstance(item, Input) or not item.required or item.stage in stage_names:
                continue
            rel, present = _upstream_output(run, entries, stages, item)
            if not present:
                missing.append(_missing_message(run, entries, item, rel))
        if missing:  # every one at once: finishing the first should not reveal the next
            return f"{name}: " + "; and ".join(missing)
    return ""


def _upstream_output(run, entries, stages, item):
    """(run-relative path, whether the run directory holds it as its stage last recorded) of Input `item`."""
    rel = stages[item.stage].OUTPUTS[item.output]
    entry = entries.get(item.stage) or {}
    recorded = entry.get("status") == "complete" and rel in entry.get("outputs", {})
    return rel, recorded and os.path.isfile(run.path(rel))


def _missing_message(run, entries, item, rel):
    status = (entries.get(item.stage) or {}).get("status")
    if status in UNFINISHED:  # its file may be there, from an earlier run: not one this run can build on
        return (f"run the {item.stage} stage first: its last run in {run.root} {UNFINISHED[status]} "
                f"(add {item.stage} to --stages to finish it, or point --run-dir at a run that has it)")
    return (f"run the {item.stage} stage first: {rel} is not in {run.root} "
            f"(add {item.stage} to --stages, or point --run-dir at a run that has it)")


UNFINISHED = {"running": "did not finish", "interrupted": "was interrupted", "failed": "failed"}


def _to_be_fetched(item, entry):
    """The digest a dry run plans with for weights the run would download first: the one the stage recorded when
    its name's sha256 prefix vouches that the download is that file again (torch checks it), else NOT_FETCHED."""
    from compress.models.weights import name_hash

    recorded, prefix = entry.get("inputs", {}).get(item.input_key), name_hash(item.path)
    return recorded if recorded and prefix and recorded.startswith(prefix) else NOT_FETCHED


def _external_sha256(item):
    path = os.path.expanduser(item.path)
    try:
        return sha256_file(path, follow_links=True)
    except InputError:
        raise InputError(f"{item.key}: cannot read '{item.path}'; check the path") from None


def _changes(run, entry, decision):
    """Why a completed stage must run again, or '' when it is up to date."""
    if not _same_config(entry, decision):
        keys = _keys_that_count(entry.get("config") or {}, decision["config"], _images_followed(decision["inputs"]))
        return f"config changed ({', '.join(keys[:4]) or 'config'})"
    for rel, sha in _as_recorded(decision["inputs"], entry.get("inputs", {})).items():
        if entry.get("inputs", {}).get(rel) != sha:
            if rel.startswith(IMAGES_DIGEST):
                return (f"the {rel.removeprefix(EXTERNAL)} changed (images added, removed, renamed, replaced, or moved "
                        "between classes or between training and validation)")
            if rel.startswith(IMAGE_BYTES_DIGEST):
                return f"the {rel.removeprefix(EXTERNAL)} changed (an image edited in place)"
            if rel.startswith(CODE_DIGEST):
                return f"the {rel.removeprefix(EXTERNAL)} changed"
            return f"its input {rel.removeprefix(EXTERNAL)} changed"
    for rel in entry.get("inputs", {}):  # an optional input it used is gone or unusable now
        if rel not in decision["inputs"]:
            return (f"its optional input {rel.removeprefix(EXTERNAL)} is not usable now (modified, gone, or its stage "
                    "unfinished)")
    for rel, sha in entry.get("outputs", {}).items():
        path = run.path(rel)
        if not os.path.isfile(path) or os.path.islink(path):
            return f"its output {rel} is missing"
        if sha256_file(path) != sha:
            return f"its output {rel} was modified"
    return ""


ROOT_CHANGED = ("data.root changed: the models this run directory holds, trained on the earlier images, are "
                "replaced as their stages run again; --name NEW (or another --run-dir) keeps them and trains the new "
                "images in a run of their own")


def root_changed(reason):
    """Whether a stage's reason to run again is a change of data.root (said once per run: ROOT_CHANGED)."""
    return reason.startswith("config changed (") and "data.root" in reason.split(")")[0]


def config_drift(run, cfg, stages, names):
    """[(stage, [config keys])] of the completed stages among `names` that `cfg` would run again because their
    config differs (as far as it changes the result) - the keys that count, named as `_changes` names them."""
    entries, found = run.manifest()["stages"], []
    for name in names:
        entry, keys = entries.get(name) or {}, stages[name].CONFIG_KEYS
        if entry.get("status") != "complete":
            continue
        recorded = entry.get("inputs") if isinstance(entry.get("inputs"), dict) else {}
        followed = _images_followed(recorded)
        now = {"config_hash": section_hash(cfg, keys), "result_hash": result_hash(cfg, keys, followed),
               "config": config_slice(cfg, keys), "inputs": recorded}  # compared as `decide` compares them
        old = entry.get("config")
        if not _same_config(entry, now) and (old is None or isinstance(old, dict)):  # else a manifest edited by hand
            found.append((name, _keys_that_count(old or {}, now["config"], followed)))
    return found


def _images_followed(inputs):
    """Whether a stage's inputs hold data.root's listing digest (an image folder's split keys then count through it)."""
    return f"{IMAGES_DIGEST} data.root" in inputs


def _keys_that_count(old, new, followed):
    """The config keys that differ between two slices, those that can change a result first: data.cache_mb changed
    beside teacher.lr is not named (and cannot push the key that counts out of the four a message shows); all the
    differing keys when none counts."""
    return _diff_keys(as_it_counts(old, followed), as_it_counts(new, followed)) or _diff_keys(old, new)


def _diff_keys(old, new, prefix=""):
    keys = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(a, dict) and isinstance(b, dict):
            keys.extend(_diff_keys(a, b, path))
        elif a != b:
            keys.append(path)
    return keys


# ---------------------------------------------------------------- where each stage stands


def stage_states(run, stages, manifest=None):
    """{stage: (state, detail)} for every stage in pipeline order (`stages`: names, or {name: stage module},
    whose PARTS let an interrupted stage say which of its parts resumes)."""
    entries = (manifest or run.manifest())["stages"]
    states = {}
    for name in stages:
        parts = getattr(stages[name], "PARTS", ()) if hasattr(stages, "keys") else ()
        states[name] = _state(run, name, entries, states, parts[1:])
    return states


def _state(run, name, entries, states, later_parts=()):
    entry = entries.get(name)
    if not entry:
        return "not run", ""
    if entry["status"] == "complete":
        for rel, sha in entry.get("inputs", {}).items():
            if rel.startswith(EXTERNAL):  # a file outside the run (pretrained weights): checked when run
                continue
            upstream = rel.split("/")[0]
            upstream_state = states.get(upstream, ("complete",))[0]
            if upstream_state in ("interrupted", "failed"):  # its record of what it writes is being redone
                return "invalidated", f"{upstream} {UNFINISHED[upstream_state]}"
            current = (entries.get(upstream) or {}).get("outputs", {}).get(rel)
            if current != sha:
                return "invalidated", f"{rel} changed since this stage ran"
            if upstream_state != "complete":
                return "invalidated", f"{upstream} is {upstream_state}"
        return "complete", ""
    if entry["status"] == "failed":
        return "failed", entry.get("message") or ""
    point, problem = read_resume(run, name)
    if point is None:
        detail = f"{problem}; will start over" if problem else "no resume checkpoint; will start over"
    elif entry.get("config_hash") and not _same_config(point.extra["_made_with"], entry):
        detail = "its resume checkpoint is of an earlier run with another config; will start over"
    else:
        detail = f"resumable at epoch {point.epoch + 1}, step {point.step}"
        epochs = ((entry.get("config") or {}).get(name) or {}).get("epochs")
        if isinstance(epochs, int) and point.epoch >= epochs:  # this part finished; a later one was interrupted
            later = next(((p, part) for part in later_parts if (p := read_resume(run, name, part)[0])), None)
            if later:
                detail = (f"its main model trained; {later[1]} resumable at epoch {later[0].epoch + 1}, step "
                          f"{later[0].step}")
    return "interrupted", detail

