"""`compress run --nproc-per-node N`: re-launch this command through torchrun's elastic launcher."""

import logging
import os
import uuid

from compress.cpus import cpu_share
from compress.errors import EXIT_INTERRUPTED


def relaunch(nproc, max_restarts, argv):
    """Run `python -m compress <argv>` in `nproc` workers on this node; return the exit code to use.

    The same as `torchrun --standalone --nproc-per-node N --max-restarts R -m compress ...`, but a worker's
    failure comes back as its exit code (its own message was already printed) instead of a launcher
    traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    # torchrun would otherwise warn that it sets this for us
    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_share(nproc)))
    # the agent's own log lines (rendezvous info, "shutting down workers", failure tables) would bury the
    # workers' one-line messages; its loggers set their own levels, so quiet each one
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args([
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        "--module", "compress", *argv])
    # what torchrun's --standalone does: a local c10d rendezvous on a free port
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, cmd, cmd_args = config_from_args(args)
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        positive = [c for c in codes if c > 0]
        return positive[0] if positive else EXIT_INTERRUPTED if any(c < 0 for c in codes) else 1
    except (SignalException, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return 0
