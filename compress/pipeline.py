"""Run the requested stages in order, deciding for each: skip (done, nothing changed), resume (interrupted,
same config and inputs), or run fresh (new, --force, or something it depends on changed).

Order of work: check everything that can be checked (config against the world, run-dir ownership, manifest)
-> take the run-dir lock -> for each stage: decide, load and check its inputs, and only then write. Rank 0
decides and writes; the decision is broadcast so every rank does the same thing.
"""

import dataclasses
import logging
import os
import time

import yaml

from compress import dist, interrupt, preflight, schema
from compress.checkpoint import read_metadata, resume_state_problem
from compress.config import read_yaml
from compress.context import File, StageContext, StageResult
from compress.errors import CompressError, InputError, Interrupted
from compress.fileio import sha256_file
from compress.report import write_report
from compress.rundir import RunDir, RunLock, now, versions
from stages import STAGES

log = logging.getLogger(__name__)

LOCK_ENV = "COMPRESS_RUN_LOCKED"  # set by `compress run --nproc-per-node`, which holds the lock for its workers


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with one stage, and what it was decided from (all JSON-able: rank 0 broadcasts it)."""

    action: str  # "skip" | "resume" | "fresh"
    reason: str
    config_hash: str
    config: dict  # the stage's slice of the config
    inputs: dict  # run-relative path -> sha256 of every file the stage reads
    sources: dict  # "stage:output" -> run-relative path of each declared input present


def run_pipeline(cfg, run_root, stage_names, force=False):
    """Run `stage_names` (canonical order) in `run_root`; returns {stage: result dict or None if skipped}.

    Nothing in the run directory changes until a stage has loaded and checked its inputs (`ctx.begin()`):
    a bad config, a missing or corrupt input, or a checkpoint of the wrong model leaves every file as it was.
    """
    run = RunDir(run_root)
    with interrupt.graceful_stop(), dist.process_group(cfg.train.device, cfg.train.threads) as env:
        saved = dist.on_main(env, _check_before_writing, cfg, run, stage_names, env.world)
        with _run_lock(run, env):
            writer = _ConfigWriter(run, cfg, saved)
            results = {}
            for name in stage_names:
                _stop_if_asked(env, f"before the {name} stage")
                decision = Decision(**dist.on_main(env, lambda n=name: dataclasses.asdict(
                    decide(run, cfg, STAGES[n], force))))
                if decision.action == "skip":
                    if env.is_main:
                        log.info("%s: up to date, skipped (%s)", name, decision.reason)
                    results[name] = None
                    continue
                results[name] = _run_stage(run, cfg, env, STAGES[name], decision, writer)
            _stop_if_asked(env, "after the last stage; every finished stage is saved")
            if env.is_main:
                results["report"] = write_report(run, STAGES)
    return results


def _stop_if_asked(env, where):
    if interrupt.requested(env):
        dist.raise_on_main(env, Interrupted(f"interrupted {where}; rerun the same command to continue"))


def _check_before_writing(cfg, run, stage_names, world):
    """Everything checkable before a file is written; returns the run directory's saved config (raw YAML
    mapping) or None."""
    preflight.check(cfg, stage_names, world)
    run.check_usable()
    run.manifest()  # a corrupt manifest is reported before any work starts
    return read_yaml(run.config_path) if os.path.isfile(run.config_path) else None


class _run_lock:
    """Rank 0 holds the run-dir lock for the whole run, unless the launcher (`--nproc-per-node`) holds it."""

    def __init__(self, run, env):
        self.run, self.env, self.lock = run, env, None

    def __enter__(self):
        held = os.environ.get(LOCK_ENV) == self.run.root

        def take():
            self.run.create()
            if not held:
                self.lock = RunLock(self.run).acquire()
        dist.on_main(self.env, take)
        return self

    def __exit__(self, *exc):
        if self.lock:
            self.lock.release()


class _ConfigWriter:
    """config.yaml holds each stage's keys as that stage last ran them: a stage that runs saves its keys (and
    the `train` section); the other stages' entries stay as they were."""

    def __init__(self, run, cfg, saved):
        self.run, self.cfg = run, cfg
        self.raw = saved if isinstance(saved, dict) else None

    def stage_began(self, spec):
        new = schema.to_dict(self.cfg)
        if self.raw is None:
            self.raw = new
        else:
            for key in (*spec.CONFIG_KEYS, "train"):
                schema.set_path(self.raw, key, _get_path(new, key))
        self.run.write_config(yaml.safe_dump(self.raw, sort_keys=False))


def _get_path(raw, dotted):
    node = raw
    for part in dotted.split("."):
        node = node[part]
    return node


class _StageRun:
    """One stage's run: `begin` is called by the stage (every rank) once its inputs are loaded and checked."""

    def __init__(self, run, env, spec, decision, writer):
        self.run, self.env, self.spec, self.decision, self.writer = run, env, spec, decision, writer
        self.begun = False
        self.start = time.perf_counter()

    def begin(self):
        if self.begun:
            return
        self.begun = True
        if self.env.is_main:
            self.writer.stage_began(self.spec)
            d = self.decision
            self.run.update_stage(self.spec.NAME, status="running", config_hash=d.config_hash, config=d.config,
                                  inputs=d.inputs, outputs={}, started=now(), finished=None,
                                  world_size=self.env.world, device=str(self.env.device), versions=versions(),
                                  message=None)
        if not self.spec.RANK0_ONLY:
            dist.barrier(self.env)

    def seconds(self):
        return round(time.perf_counter() - self.start, 2)


def _run_stage(run, cfg, env, spec, decision, writer):
    name = spec.NAME
    if env.is_main:
        log.info("%s: %s", name, decision.reason)
    state = _StageRun(run, env, spec, decision, writer)
    sources = {tuple(key.split(":", 1)): rel for key, rel in decision.sources.items()}
    ctx = StageContext(cfg, run, env, name, decision.config_hash, decision.inputs, sources,
                       resume=decision.action == "resume", begin=state.begin)
    try:
        if spec.RANK0_ONLY:
            result = StageResult(**dist.on_main(env, lambda: vars(spec.run(ctx))))
        else:
            result = spec.run(ctx)
    except BaseException as e:
        if env.is_main and state.begun:
            status = "interrupted" if isinstance(e, (Interrupted, KeyboardInterrupt)) else "failed"
            message = str(e) if isinstance(e, CompressError) else f"{e.__class__.__name__}: {e}"
            run.update_stage(name, status=status, finished=now(), message=message, seconds=state.seconds())
        raise
    state.begin()  # no-op when the stage called it, as stages do
    if env.is_main:
        outputs = {rel: sha256_file(run.path(rel)) for rel in result.outputs}
        run.update_stage(name, status="complete", outputs=outputs, metrics=result.metrics, finished=now(),
                         seconds=state.seconds(), resumed=ctx.resume)
        log.info("%s: done in %.1fs - %s", name, state.seconds(), result.summary)
    dist.barrier(env)
    return vars(result)


def decide(run, cfg, spec, force):
    """The Decision for one stage."""
    from compress.config import config_slice, section_hash
    from compress.status import stage_states

    manifest = run.manifest()
    stages = manifest["stages"]
    states = stage_states(run, STAGES, manifest)
    inputs, sources = {}, {}
    for item in spec.inputs(cfg):
        if isinstance(item, File):
            inputs[item.input_key] = _external_sha256(item)
            continue
        rel = STAGES[item.stage].OUTPUTS[item.output]
        entry = stages.get(item.stage) or {}
        recorded = entry.get("status") == "complete" and rel in entry.get("outputs", {})
        present = recorded and os.path.isfile(run.path(rel))
        if not item.required and not (present and states[item.stage][0] == "complete"):
            continue
        if not present:
            raise InputError(f"run the {item.stage} stage first: {rel} is not in {run.root} "
                             f"(add {item.stage} to --stages, or point --run-dir at a run that has it)")
        if states[item.stage][0] != "complete":
            log.warning("%s: reading %s from the %s stage, which is stale (%s)", spec.NAME, rel, item.stage,
                        states[item.stage][1])
        inputs[rel] = entry["outputs"][rel]
        sources[f"{item.stage}:{item.output}"] = rel
    base = {"config_hash": section_hash(cfg, spec.CONFIG_KEYS), "config": config_slice(cfg, spec.CONFIG_KEYS),
            "inputs": inputs, "sources": sources}
    entry = stages.get(spec.NAME)
    if force:
        return Decision("fresh", "running (--force)", **base)
    if entry and entry.get("status") == "complete":
        changed = _changes(run, entry, base)
        if not changed:
            return Decision("skip", "same config and inputs", **base)
        return Decision("fresh", f"running again: {changed}", **base)
    ckpt = run.resume_checkpoint(spec.NAME)
    if os.path.isfile(ckpt):
        return _resume_or_restart(cfg, spec, ckpt, base)
    return Decision("fresh", "running", **base)


def _external_sha256(item):
    path = os.path.expanduser(item.path)
    try:
        return sha256_file(path, follow_links=True)
    except InputError:
        raise InputError(f"{item.key}: cannot read '{item.path}'; check the path") from None


def _resume_or_restart(cfg, spec, ckpt, base):
    try:
        state = read_metadata(ckpt).get("state")
    except CompressError as e:
        return Decision("fresh", f"the resume checkpoint is unreadable ({e}); starting over", **base)
    epochs = getattr(getattr(cfg, spec.NAME, None), "epochs", None)
    problem = resume_state_problem(state, epochs)
    if problem:
        return Decision("fresh", f"the resume checkpoint is damaged ({problem}); starting over", **base)
    if state.get("config_hash") != base["config_hash"] or state.get("inputs") != base["inputs"]:
        return Decision("fresh", "the interrupted run used another config or inputs; starting over", **base)
    where = ("after its last epoch" if epochs is not None and state["epoch"] >= epochs
             else f"at epoch {state['epoch'] + 1}, step {state['step']}")
    return Decision("resume", f"resuming the interrupted run {where}", **base)


def _changes(run, entry, decision):
    """Why a completed stage must run again, or '' when it is up to date."""
    if entry.get("config_hash") != decision["config_hash"]:
        keys = _diff_keys(entry.get("config") or {}, decision["config"])
        return f"config changed ({', '.join(keys[:4]) or 'config'})"
    for rel, sha in decision["inputs"].items():
        if entry.get("inputs", {}).get(rel) != sha:
            return f"its input {rel.removeprefix('external:')} changed"
    for rel, sha in entry.get("outputs", {}).items():
        path = run.path(rel)
        if not os.path.isfile(path) or os.path.islink(path):
            return f"its output {rel} is missing"
        if sha256_file(path) != sha:
            return f"its output {rel} was modified"
    return ""


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
