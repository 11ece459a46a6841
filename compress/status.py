"""The state of each stage in a run directory: complete (and current), invalidated, interrupted, failed or
not run. A complete stage is current only while every file it read is still what its upstream stage last
wrote *and* that upstream stage is itself current: retraining the teacher makes distill, qat and export stale.
"""

import os

from compress.checkpoint import read_metadata
from compress.errors import CompressError


def stage_states(run, stages, manifest=None):
    """{stage: (state, detail)} for every stage in pipeline order."""
    entries = (manifest or run.manifest())["stages"]
    states = {}
    for name in stages:
        states[name] = _state(run, name, entries, states)
    return states


def _state(run, name, entries, states):
    entry = entries.get(name)
    if not entry:
        return "not run", ""
    if entry["status"] == "complete":
        for rel, sha in entry.get("inputs", {}).items():
            if rel.startswith("external:"):  # a file outside the run (pretrained weights): checked when run
                continue
            upstream = rel.split("/")[0]
            current = (entries.get(upstream) or {}).get("outputs", {}).get(rel)
            if current != sha:
                return "invalidated", f"{rel} changed since this stage ran"
            if states.get(upstream, ("complete",))[0] != "complete":
                return "invalidated", f"{upstream} is {states[upstream][0]}"
        return "complete", ""
    if entry["status"] == "failed":
        return "failed", entry.get("message") or ""
    return "interrupted", _resumable(run, name)  # "interrupted", or "running" when it was killed


def _resumable(run, name):
    ckpt = run.resume_checkpoint(name)
    if not os.path.isfile(ckpt):
        return "no resume checkpoint; will start over"
    try:
        state = read_metadata(ckpt).get("state") or {}
        return f"resumable at epoch {int(state.get('epoch', 0)) + 1}, step {int(state.get('step', 0))}"
    except (CompressError, TypeError, ValueError):
        return "resume checkpoint unreadable; will start over"
