"""Run the requested stages in order, deciding for each: skip (done, nothing changed), resume (interrupted,
same config and inputs), or run fresh (new, --force, or something it depends on changed).

Rank 0 decides and writes the manifest; the decision is broadcast so every rank does the same thing.
"""

import logging
import os
import time

from compress import dist, interrupt
from compress.checkpoint import read_metadata, sha256_file
from compress.config import config_slice, dump_config, section_hash
from compress.context import StageContext, StageResult
from compress.errors import CompressError, InputError, Interrupted
from compress.report import write_report
from compress.rundir import RunDir, now, versions
from stages import STAGES

log = logging.getLogger(__name__)


def run_pipeline(cfg, run_root, stage_names, force=False):
    """Run `stage_names` (canonical order) in `run_root`; returns {stage: result dict or None if skipped}.

    Nothing in the run directory changes until a stage has loaded and checked its inputs (`ctx.begin()`):
    a bad config, a missing or corrupt input, or a checkpoint of the wrong model leaves every file as it was.
    """
    run = RunDir(run_root)
    results, written = {}, {"config": False}
    with interrupt.graceful_stop(), dist.process_group(cfg.train.device, cfg.train.threads) as env:
        dist.on_main(env, _check_run_dir, run)
        for name in stage_names:
            if interrupt.requested(env):
                dist.raise_on_main(env, Interrupted(f"interrupted before the {name} stage; rerun the same command "
                                                    "to continue"))
            decision = dist.on_main(env, decide, run, cfg, STAGES[name], force)
            if decision["action"] == "skip":
                if env.is_main:
                    log.info("%s: up to date, skipped (%s)", name, decision["reason"])
                results[name] = None
                continue
            results[name] = _run_stage(run, cfg, env, STAGES[name], decision, written)
        if env.is_main:
            if not written["config"]:
                run.write_config(dump_config(cfg))
            results["report"] = write_report(run)
    return results


def _check_run_dir(run):
    run.prepare()
    run.manifest()  # a corrupt manifest is reported before any work starts


def _run_stage(run, cfg, env, spec, decision, written):
    name = spec.NAME
    if env.is_main:
        log.info("%s: %s", name, decision["reason"])
    begun = []
    start = time.perf_counter()

    def begin():
        """Called by the stage (every rank) once its inputs are loaded and checked, before it writes."""
        if begun:
            return
        begun.append(True)
        if env.is_main:
            if not written["config"]:
                run.write_config(dump_config(cfg))
                written["config"] = True
            run.update_stage(name, status="running", config_hash=decision["config_hash"],
                             config=decision["config"], inputs=decision["inputs"], outputs={}, started=now(),
                             finished=None, world_size=env.world, device=str(env.device), versions=versions(),
                             message=None)
        if not spec.RANK0_ONLY:
            dist.barrier(env)

    ctx = StageContext(cfg, run, env, name, decision["config_hash"], decision["inputs"],
                       resume=decision["action"] == "resume", begin=begin)
    try:
        if spec.RANK0_ONLY:
            result = StageResult(**dist.on_main(env, lambda: vars(spec.run(ctx))))
        else:
            result = spec.run(ctx)
    except BaseException as e:
        if env.is_main and begun:
            status = "interrupted" if isinstance(e, (Interrupted, KeyboardInterrupt)) else "failed"
            message = str(e) if isinstance(e, CompressError) else f"{e.__class__.__name__}: {e}"
            run.update_stage(name, status=status, finished=now(), message=message,
                             seconds=round(time.perf_counter() - start, 2))
        raise
    begin()  # no-op when the stage called it, as stages do
    if env.is_main:
        outputs = {rel: sha256_file(run.path(rel)) for rel in result.outputs}
        run.update_stage(name, status="complete", outputs=outputs, metrics=result.metrics, finished=now(),
                         seconds=round(time.perf_counter() - start, 2), resumed=ctx.resume)
        log.info("%s: done in %.1fs - %s", name, time.perf_counter() - start, result.summary)
    dist.barrier(env)
    return vars(result)


def decide(run, cfg, spec, force):
    """{"action": skip|resume|fresh, "reason", "config_hash", "config", "inputs"} for one stage."""
    stages = run.manifest()["stages"]
    inputs = {}
    for upstream, rel in spec.inputs(cfg):
        entry = stages.get(upstream) or {}
        recorded = entry.get("status") == "complete" and rel in entry.get("outputs", {})
        if not recorded or not os.path.isfile(run.path(rel)):
            raise InputError(f"run the {upstream} stage first: {rel} is not in {run.root} "
                             f"(add {upstream} to --stages, or point --run-dir at a run that has it)")
        inputs[rel] = entry["outputs"][rel]
    decision = {"config_hash": section_hash(cfg, spec.CONFIG_KEYS), "config": config_slice(cfg, spec.CONFIG_KEYS),
                "inputs": inputs}
    entry = stages.get(spec.NAME)
    if force:
        return {**decision, "action": "fresh", "reason": "running (--force)"}
    if entry and entry.get("status") == "complete":
        changed = _changes(run, entry, decision)
        if not changed:
            return {**decision, "action": "skip", "reason": "same config and inputs"}
        return {**decision, "action": "fresh", "reason": f"running again: {changed}"}
    ckpt = run.resume_checkpoint(spec.NAME)
    if os.path.isfile(ckpt):
        state = read_metadata(ckpt).get("state") or {}
        if state.get("config_hash") == decision["config_hash"] and state.get("inputs") == inputs:
            epochs = getattr(getattr(cfg, spec.NAME, None), "epochs", None)
            where = ("after its last epoch" if epochs is not None and state["epoch"] >= epochs
                     else f"at epoch {state['epoch'] + 1}, step {state['step']}")
            return {**decision, "action": "resume", "reason": f"resuming the interrupted run {where}"}
        return {**decision, "action": "fresh",
                "reason": "the interrupted run used another config or inputs; starting over"}
    return {**decision, "action": "fresh", "reason": "running"}


def _changes(run, entry, decision):
    """Why a completed stage must run again, or '' when it is up to date."""
    if entry.get("config_hash") != decision["config_hash"]:
        keys = _diff_keys(entry.get("config") or {}, decision["config"])
        return f"config changed ({', '.join(keys[:4]) or 'config'})"
    for rel, sha in decision["inputs"].items():
        if entry.get("inputs", {}).get(rel) != sha:
            return f"its input {rel} changed"
    for rel, sha in entry.get("outputs", {}).items():
        path = run.path(rel)
        if not os.path.isfile(path):
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


def stage_status(run, spec, manifest=None):
    """(state, detail) of a stage in a run dir: complete, invalidated, interrupted, failed or not run."""
    manifest = manifest or run.manifest()
    stages = manifest["stages"]
    entry = stages.get(spec.NAME)
    if not entry:
        return "not run", ""
    if entry["status"] == "complete":
        for rel, sha in entry.get("inputs", {}).items():
            upstream = stages.get(rel.split("/")[0]) or {}
            if upstream.get("outputs", {}).get(rel) != sha:
                return "invalidated", f"{rel} changed since this stage ran"
        return "complete", ""
    ckpt = run.resume_checkpoint(spec.NAME)
    where = ""
    if os.path.isfile(ckpt):
        try:
            state = read_metadata(ckpt).get("state") or {}
            where = f" at epoch {state.get('epoch', 0) + 1}, step {state.get('step', 0)}"
        except CompressError:
            where = " (resume checkpoint unreadable)"
    if entry["status"] == "failed":
        return "failed", entry.get("message") or ""
    return "interrupted", f"resumable{where}" if where else "no resume checkpoint; will start over"
