"""The one distributed code path: DDP over torch.distributed, launched by torchrun's elastic launcher.

Workers learn rank and world size from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...); a plain
`compress run` is a world of one and needs no process group. Every rank computes and meets every barrier;
only rank 0 writes files and shows progress. Decisions that must agree (which stage to skip, an error found
while reading inputs) are made on rank 0 and broadcast, so all ranks raise the same error together instead
of some of them waiting forever at the next collective.
"""

import contextlib
import datetime
import gc
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from compress.cpus import training_threads, usable_cpus
from compress.errors import CompressError, ConfigError, InputError, MirroredError
from compress.fileio import dumps
from compress.torchrun import env_count, launched_by_torchrun

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = ""  # "" when there is no process group
    threads: str = ""  # the intra-op threads per process, and why ("2 (2 usable CPUs)")
    check_neighbours: bool = False  # we chose the thread count of a lone CPU process: see whether others are busy

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world > 1




PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher():
    """On Linux, have the kernel send this torchrun worker SIGTERM when the process that started it dies: a
    launcher killed with kill -9 forwards no signal, and its workers (each in a session of its own) would go on
    training, unlocked and unseen, beside the next run of the directory. SIGTERM is a graceful stop: the worker
    checkpoints and exits like after Ctrl-C. A worker whose launcher is already gone stops at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl to call: nothing to ask for
        return
    if os.getppid() == 1:  # orphaned before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _env_int(name, default):
    try:
        return env_count(name, default)
    except ValueError as e:
        raise InputError(str(e)) from None


NO_CUDA = "train.device (--device): cuda was asked for but torch sees no CUDA device; use --device cpu or auto"


def pick_device(preference, local_rank):
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError([NO_CUDA])  # the words the preflight (dry run, launcher) says it in
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@contextlib.contextmanager
def process_group(device_preference="auto", threads=None, timeout_minutes=30):
    """Set up the process group for this worker (if world > 1) and always tear it down, also on error."""
    launched = launched_by_torchrun()  # a stray RANK alone is no launch: this process is the only one
    rank, world = (_env_int("RANK", 0), _env_int("WORLD_SIZE", 1)) if launched else (0, 1)
    local_rank, local_world = (_env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)) if launched else (0, 1)
    if not 0 <= rank < world:
        raise InputError(f"RANK={rank} is not one of WORLD_SIZE={world}'s ranks (0 to {world - 1}); these variables "
                         "come from torchrun: unset RANK and WORLD_SIZE to run one process, or launch with torchrun")
    device = pick_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    why = "train.threads"
    if not threads:
        threads, why = training_threads(local_world)
    elif local_world > 1 and threads * local_world > usable_cpus() and _env_int("LOCAL_RANK", 0) == 0:
        log.warning("train.threads=%d in each of %d processes is %d threads on %d usable CPUs: they wait for each "
                    "other, and training slows many times over; drop train.threads (the default shares the CPUs "
                    "among the processes) or set it to %d", threads, local_world, threads * local_world,
                    usable_cpus(), max(1, usable_cpus() // local_world))
    torch.set_num_threads(threads)
    backend = ""
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=timeout_minutes)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        store = _attempt_store(world, timeout)
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world)
        _import_modules_that_bind_the_world_group()
        with _stoppable(), _said_if_slow(rank, world, local_world):
            tdist.init_process_group(backend, timeout=timeout, **kwargs)
    ours = why not in ("train.threads", "OMP_NUM_THREADS")  # a count the user chose is theirs to keep
    env = DistEnv(rank, world, local_rank, local_world, device, backend, f"{threads} ({why})",
                  check_neighbours=ours and device.type == "cpu" and threads > 1 and local_world == 1)
    try:
        yield env
    except BaseException:
        _teardown(env, clean=False)
        raise
    _teardown(env, clean=True)


WAIT_SAID_AFTER_S = 5.0  # peers on other nodes that are up meet within seconds; a longer wait is worth a line
LOCAL_WAIT_SAID_AFTER_S = 60.0  # one launcher started every peer: only a machine far too busy lags them a minute


@contextlib.contextmanager
def _said_if_slow(rank, world, local_world):
    """Rank 0 says what it waits for once the rendezvous has taken WAIT_SAID_AFTER_S (LOCAL_WAIT_SAID_AFTER_S when
    every peer is on this machine, started by one launcher, seconds apart on a busy machine): a peer that never
    comes (another node not started, a wrong MASTER_ADDR) is then named, and a group that meets prints nothing.
    The wait is native code that releases the GIL, so a timer thread can speak during it."""
    timer = None
    if rank == 0:
        after = LOCAL_WAIT_SAID_AFTER_S if local_world >= world else WAIT_SAID_AFTER_S
        timer = threading.Timer(after, log.info, args=(
            "waiting for the other %d process(es) of WORLD_SIZE=%d at %s:%s (Ctrl-C stops the wait)", world - 1,
            world, os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


@contextlib.contextmanager
def _stoppable():
    """Ctrl-C and SIGTERM end the process while it waits in the rendezvous: that wait is native code, where the
    graceful handlers (which only set a flag for the training loop) never run - a peer that never comes would keep
    it for the whole timeout. Nothing has been written yet, so the default action loses nothing."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sig in kept:
            signal.signal(sig, signal.SIG_DFL)
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


def _import_modules_that_bind_the_world_group():
    """torch.distributed.nn.functional binds `group.WORLD` as the default argument of its collectives when it
    is first imported. DDP's constructor imports it (DDP -> torch._dynamo -> torch.distributed._shard), so
    after init_process_group it would capture the live default group for the life of the interpreter:
    destroy_process_group() could not free that group, and its gloo threads (two pt_gloo_runloop, one
    gloo_tcp_loop) were still running in every worker while Python finalized - the state a worker can die in
    after a complete stage ("terminate called without an active exception"). Imported before the group
    exists, the default is None. tests/training/test_distributed.py checks every worker's threads at exit."""
    import torch.distributed.nn.functional  # noqa: F401  (about 3 ms)


def _teardown(env, clean):
    """Tear the process group down while the interpreter is fully alive: destroy_process_group() drops the
    last reference to the group, whose destructor joins its gloo threads here and now, not in the middle of
    interpreter shutdown. After a clean run the barrier makes all ranks leave together, so no rank tears down
    while a peer still writes (the report) or talks to it; garbage is collected first in case a DDP module,
    which also holds the group, is left in a reference cycle. After an error a peer may be gone: no barrier."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return
    if clean:
        barrier(env)
    gc.collect()
    tdist.destroy_process_group()
    gc.collect()


def _attempt_store(world, timeout):
    """The elastic agent's store, with keys private to this restart attempt. After torchrun restarts a group
    (--max-restarts), the agent's store still holds the dead workers' gloo addresses under the same keys,
    and a new worker can read a stale one and wait forever to connect to it; a per-attempt prefix avoids
    that. None (use env://) when the agent does not host the store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    client = tdist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), world, is_master=False,
                            timeout=timeout)
    return tdist.PrefixStore(f"compress/attempt_{attempt}", client)


def barrier(env):
    if env.distributed:
        if env.backend == "nccl":
            tdist.barrier(device_ids=[env.device.index])
        else:
            tdist.barrier()


def _comm(env, tensor):
    """Collectives on nccl need CUDA tensors; gloo takes CPU tensors."""
    return tensor.to(env.device) if env.backend == "nccl" else tensor


def all_reduce(env, tensor, op="sum"):
    """All-reduce a CPU tensor (sum or max) and return it on the CPU."""
    if not env.distributed:
        return tensor
    t = _comm(env, tensor.clone())
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM if op == "sum" else tdist.ReduceOp.MAX)
    return t.cpu()


def broadcast_tensor(env, tensor):
    if not env.distributed:
        return tensor
    t = _comm(env, tensor.clone())
    tdist.broadcast(t, src=0)
    return t.cpu()


def all_gather_tensor(env, tensor):
    """Every rank's copy of a same-shaped CPU tensor, in rank order, on the CPU. Sent as bytes, so any dtype
    goes through any backend."""
    if not env.distributed:
        return [tensor]
    flat = tensor.contiguous().view(-1).view(torch.uint8) if tensor.dim() else tensor.view(1).view(torch.uint8)
    t = _comm(env, flat)
    out = [torch.empty_like(t) for _ in range(env.world)]
    tdist.all_gather(out, t)
    return [o.cpu().view(tensor.dtype).view(tensor.shape) for o in out]


def gather_bytes(env, data):
    """Every rank's `data` (bytes of any length, b"" for none), in rank order, on rank 0; [] on the other ranks,
    which hold only their own (a rank decoding images sends its chunk to the one rank that writes it)."""
    if not env.distributed:
        return [data]
    sizes = all_gather_tensor(env, torch.tensor([len(data)], dtype=torch.long))
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(1, longest), dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    t = _comm(env, buf)
    out = [torch.empty_like(t) for _ in range(env.world)] if env.is_main else None
    tdist.gather(t, gather_list=out, dst=0)
    if not env.is_main:
        return []
    return [o.cpu()[:int(n.item())].numpy().tobytes() for o, n in zip(out, sizes)]


def broadcast_json(env, obj=None):
    """Rank 0's JSON-able `obj`, on every rank (JSON bytes in a tensor: no pickle)."""
    if not env.distributed:
        return obj
    data = dumps(obj).encode() if env.is_main else b""
    size = broadcast_tensor(env, torch.tensor([len(data)], dtype=torch.long))
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if env.is_main:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return json.loads(bytes(broadcast_tensor(env, buf).numpy().tobytes()).decode())


def on_main(env, fn, *args, **kwargs):
    """Run `fn` on rank 0 only and hand its JSON-able result to every rank. A CompressError raised by `fn`
    is raised on every rank, so no rank is left waiting at a collective."""
    result, error = None, None
    if env.is_main:
        try:
            result = fn(*args, **kwargs)
        except CompressError as e:
            error = e
    if not env.distributed:
        if error:
            raise error
        return result
    message = broadcast_json(env, {"result": result} if error is None else
                             {"error": str(error), "exit_code": error.exit_code})
    if error is not None:
        raise error
    if "error" in message:
        raise MirroredError(message["error"], message["exit_code"])
    return message["result"]


def sync_buffers(env, module):
    """Give every rank rank 0's buffers (BN statistics, observer ranges): each rank updated its own copy
    from its own shard, and rank 0's copy is the one that gets saved and evaluated."""
    if env.distributed:
        for buffer in module.buffers():
            tdist.broadcast(buffer.data, src=0)


def raise_on_main(env, error):
    """Raise a failure that every rank detected together: rank 0 raises (and reports) it, the others raise a
    silent copy, so the user reads it once."""
    if env.is_main:
        raise error
    raise MirroredError(str(error), error.exit_code)


def fail_if(env, condition, message):
    """`raise_on_main(StageFailed(message))` when `condition` holds (it must be the same on every rank)."""
    if condition:
        from compress.errors import StageFailed

        raise_on_main(env, StageFailed(message))


def replica_mismatches(env, module, buffers=True):
    """Names of parameters (and buffers) that differ from rank 0's copy; [] on every rank when all agree."""
    if not env.distributed:
        return []
    named = list(module.named_parameters()) + (list(module.named_buffers()) if buffers else [])
    bad = []
    for name, value in named:
        mine = value.detach().float().cpu() if value.is_floating_point() else value.detach().cpu()
        theirs = broadcast_tensor(env, mine)
        differs = torch.tensor([0 if torch.equal(mine, theirs) else 1], dtype=torch.long)
        if all_reduce(env, differs, op="max").item():
            bad.append(name)
    return bad


def check_replicas(env, module, what, buffers=True):
    """Compare every parameter (and buffer) with rank 0's copy and fail the stage, naming the first
    tensors, when any rank holds another value. Returns what was measured for the metrics: True when every
    rank agreed, None when there is a single process (nothing to compare)."""
    if not env.distributed:
        return None
    mismatched = replica_mismatches(env, module, buffers)
    fail_if(env, mismatched, f"{what}: ranks disagree on {len(mismatched)} tensors after training "
                             f"({', '.join(mismatched[:3])}); DDP went out of sync")
    return True


def peak_rss_mb(env):
    """Every rank's peak resident memory so far (MB), in rank order."""
    import resource

    mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    return [round(float(t.item()), 1) for t in all_gather_tensor(env, mine)]


def per_rank_batch(global_batch, env, key):
    """The global batch size split evenly over the processes."""
    if global_batch % env.world:
        raise InputError(f"{key}={global_batch} does not split evenly over {env.world} processes; "
                         f"use a multiple of {env.world}")
    return global_batch // env.world


def wrap_ddp(model, env, **kwargs):
    """DDP around an already-placed model when distributed; the model itself otherwise."""
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(model, device_ids=ids, **kwargs)
