"""What the environment says about this process's place in a torchrun launch, read without importing torch (the
CLI reads it before anything heavy loads). A RANK left in the environment without WORLD_SIZE (a shell that once
ran a distributed job) is no launch: the process is the only one, rank 0."""

import os

ATTEMPT_ENV = "COMPRESS_LAUNCH_ATTEMPT"  # 0 for the first start of the group; a restart resumes, never forces
RESTARTS_ENV = "COMPRESS_LAUNCH_MAX_RESTARTS"  # `compress run --max-restarts`, for a worker that loses a peer
NPROC_ENV = "COMPRESS_LAUNCH_NPROC"  # `compress run --nproc-per-node`, kept in the commands a worker suggests


def run_command(environ=None):
    """`compress run` as a command this process suggests should start it, launched as this run was, so a pasted
    refresh trains in as many processes: `--nproc-per-node N` for compress's own launcher and for torchrun on one
    node (the same launch), `torchrun ... -m compress run` for several nodes (only the user knows their flags)."""
    environ = os.environ if environ is None else environ
    nproc = environ.get(NPROC_ENV) or ""
    if not nproc.isdigit() and launched_by_torchrun(environ):
        world, local = environ.get("WORLD_SIZE") or "", environ.get("LOCAL_WORLD_SIZE") or ""
        if world.isdigit() and int(world) > 1:
            if local != world:
                return "torchrun ... -m compress run"
            nproc = world
    return f"compress run --nproc-per-node {nproc}" if nproc.isdigit() and int(nproc) > 1 else "compress run"


def restarts_left(environ=None):
    """(restarts the launcher has left for this worker group, whether any were asked for): compress's own
    launcher's counts, else torchrun's (which compress's launcher runs with none of its own)."""
    environ = os.environ if environ is None else environ
    for count, most in ((ATTEMPT_ENV, RESTARTS_ENV), ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")):
        if (environ.get(most) or "").isdigit():
            done = int(environ.get(count) or 0) if (environ.get(count) or "0").isdigit() else 0
            return max(0, int(environ[most]) - done), int(environ[most]) > 0
    return 0, False


def launched_by_torchrun(environ=None):
    """Whether torchrun (or an equivalent launcher) started this process as one of a group."""
    environ = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in environ or ("RANK" in environ and "WORLD_SIZE" in environ)


def env_count(name, default=0, environ=None):
    """A whole number a launcher put in the environment (RANK, WORLD_SIZE, a restart count), or `default` when
    unset; anything else is one sentence naming the variable (the caller raises it: this module imports nothing
    of compress)."""
    environ = os.environ if environ is None else environ
    value = environ.get(name)
    if value is None or value == "":
        return default
    if not value.strip().isascii() or not value.strip().isdigit():
        raise ValueError(f"{name}={value!r} is not a whole number >= 0; it comes from torchrun (or your scheduler): "
                         f"unset it to run one process, or launch with torchrun")
    return int(value)


def env_rank():
    """This process's rank in its launch: RANK under a launcher, 0 otherwise."""
    if not launched_by_torchrun():
        return 0
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
