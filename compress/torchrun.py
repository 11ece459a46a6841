"""What the environment says about this process's place in a torchrun launch, read without importing torch (the
CLI reads it before anything heavy loads). A RANK left in the environment without WORLD_SIZE (a shell that once
ran a distributed job) is no launch: the process is the only one, rank 0."""

import os


def launched_by_torchrun():
    """Whether torchrun (or an equivalent launcher) started this process as one of a group."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def env_rank():
    """This process's rank in its launch: RANK under a launcher, 0 otherwise."""
    if not launched_by_torchrun():
        return 0
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
