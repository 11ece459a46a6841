"""Everything about a run that can be checked before a single file is written, in one explicit step.

`compress.config` checks what the YAML says on its own (types, ranges, finite numbers). This module checks it
against the world: the dataset folder exists, the model names resolve, weight files are there, and every
training stage's global batch splits evenly over the processes of this launch. Every problem is reported at
once, with its key, like a config error.
"""

import os

from compress.errors import ConfigError

TRAINING_STAGES = ("teacher", "distill", "qat")


def problems(cfg, stage_names, world_size):
    """The list of problems (empty when the run can start)."""
    found = []
    data = cfg.data
    if data.root and not data.download and not os.path.isdir(os.path.expanduser(data.root)):
        found.append(f"data.root: folder '{data.root}' does not exist; point data.root at the dataset")
    from compress.models import source_problem

    for key, name in (("model.teacher", cfg.model.teacher), ("model.student", cfg.model.student)):
        problem = source_problem(name)
        if problem:
            found.append(f"{key}: {problem}")
    for stage in stage_names:
        if stage in TRAINING_STAGES:
            batch = getattr(cfg, stage).batch_size
            if batch % world_size:
                found.append(f"{stage}.batch_size: {batch} does not split evenly over {world_size} processes; "
                             f"use a multiple of {world_size}")
    return found


def check(cfg, stage_names, world_size, source=None):
    """Raise one ConfigError listing every problem found by `problems`."""
    found = problems(cfg, stage_names, world_size)
    if found:
        raise ConfigError(found, source=source)
