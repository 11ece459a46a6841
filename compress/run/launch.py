"""`compress run --nproc-per-node N`: re-launch this command through torchrun's elastic launcher."""

import logging
import os
import signal
import uuid

from compress.cpus import cpu_share
from compress.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from compress.torchrun import ATTEMPT_ENV, NPROC_ENV, RESTARTS_ENV

# exit codes a restart cannot change: the input is bad (the same error again) or the user stopped the run
_FINAL = (EXIT_BAD_INPUT, EXIT_INTERRUPTED)
# the signals the launcher itself stops the other workers with when one fails: a consequence, never a cause
_STOPPED_BY_LAUNCHER = (signal.SIGTERM, signal.SIGINT)

log = logging.getLogger(__name__)


def relaunch(nproc, max_restarts, argv):
    """Run `python -m compress <argv>` in `nproc` workers on this node; return the exit code to use.

    The same as `torchrun --standalone --nproc-per-node N --max-restarts R -m compress ...`, but a worker's
    failure comes back as its exit code (its own message was already printed) instead of a launcher
    traceback, and the group is restarted only when a restart can help: when a worker died (killed, out of
    memory, crashed), not when one refused its input, failed a stage's own check or was stopped (each would
    only say the same again)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        return _start_until_done(nproc, max_restarts, argv)
    except (SignalException, KeyboardInterrupt):  # also between two starts: torch's handlers stay installed
        return EXIT_INTERRUPTED


def _start_until_done(nproc, max_restarts, argv):
    for attempt in range(max_restarts + 1):
        os.environ[ATTEMPT_ENV] = str(attempt)  # the workers' `compress run` drops --force after the first
        os.environ[RESTARTS_ENV] = str(max_restarts)
        os.environ[NPROC_ENV] = str(nproc)
        try:
            codes = _launch_once(nproc, argv)
        finally:
            for name in (ATTEMPT_ENV, RESTARTS_ENV, NPROC_ENV):
                os.environ.pop(name, None)
        if codes is None:
            return EXIT_INTERRUPTED
        if not codes:
            return 0
        # a death is the cause even where the launcher's stop made another worker exit 130 (stopped)
        if not _died(codes) or EXIT_BAD_INPUT in codes or attempt == max_restarts:
            break
        log.warning("%s; restarting the %d processes (%d of %d), which resume from the last checkpoint",
                    _failure_words(codes), nproc, attempt + 1, max_restarts)
    return _exit_code(codes)


def _died(codes):
    """The signals that killed workers, leaving out the launcher's own stop of the others."""
    return [-c for c in codes if c < 0 and -c not in _STOPPED_BY_LAUNCHER]


def _exit_code(codes):
    """The group's exit code from its failed workers': a final one (bad input, stopped) first, then any other a
    worker chose, else an interruption when workers were killed."""
    for pick in (lambda c: c in _FINAL, lambda c: c > 0):
        found = [c for c in codes if pick(c)]
        if found:
            return found[0]
    return EXIT_INTERRUPTED if any(c < 0 for c in codes) else 1


def _failure_words(codes):
    names = ", ".join(_signal_name(s) for s in sorted(set(_died(codes))))
    return f"a worker was killed ({names})"


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _launch_once(nproc, argv):
    """One start of the worker group: [] when every worker ended well, the failed workers' exit codes (negative: the
    signal that killed it), or None when the launcher itself was stopped (Ctrl-C, SIGTERM)."""
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
    # --log-dir /dev/null: the workers print to this terminal and their exit codes say how they ended, so the
    # agent keeps no per-worker folders (by default a /tmp/torchelastic_* folder left behind by every start)
    args = get_args_parser().parse_args([f"--nproc-per-node={nproc}", "--max-restarts=0", f"--log-dir={os.devnull}",
                                         "--module", "compress", *argv])
    # what torchrun's --standalone does: a local c10d rendezvous on a free port (a new one for each start)
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, cmd, cmd_args = config_from_args(args)
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as e:
        return [f.exitcode for f in e.failures.values()]
    except (SignalException, KeyboardInterrupt):
        return None
    return []


def first_attempt():
    """Whether this is a worker group's first attempt: one restarted after losing a worker (by torchrun, or by
    --max-restarts) resumes instead of redoing the stages --force asked for."""
    from compress.errors import InputError
    from compress.torchrun import env_count

    try:
        return not any(env_count(k) for k in ("TORCHELASTIC_RESTART_COUNT", ATTEMPT_ENV))
    except ValueError as e:
        raise InputError(str(e)) from None
