"""How many CPUs this process may use, and how many threads a training process takes by default: one place
for both, read by training, the launcher, QAT's latency probe and the deployment timings.

The count is the process's affinity mask (what `taskset`, a container's cpuset or a SLURM allocation grants),
not the machine's: 4 CPUs of a 128-core node are 4. Threads beyond the free cores are ruinous for the small
operations of CPU training: each parallel region waits for its slowest thread, and a thread sharing a core with
another busy process waits a scheduler slice (BENCHMARKS.md: 374 against 3,133 images/s)."""

import os

# Set by torchrun (and `compress run --nproc-per-node`) in every worker: there OMP_NUM_THREADS may be torchrun's
# own default of 1, not the user's choice, so the per-process share of the CPUs is used instead.
ELASTIC_WORKER_ENV = "TORCHELASTIC_RUN_ID"


def usable_cpus():
    """CPUs this process may run on (its affinity mask), at least 1."""
    return max(1, len(usable_set()))


def training_threads(local_world=1, environ=None):
    """(threads, why) for a training process when train.threads is not set: OMP_NUM_THREADS when the user set
    it for a single-process run (as torch itself honours it), else the usable CPUs shared by the processes on
    this node."""
    environ = os.environ if environ is None else environ
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0 and ELASTIC_WORKER_ENV not in environ:
        return int(omp), "OMP_NUM_THREADS"
    cpus = usable_cpus()
    return cpu_share(local_world), (f"{cpus} usable CPUs" if local_world <= 1 else
                                    f"{cpus} usable CPUs / {local_world} processes")


def cpu_share(processes):
    """Threads for each of `processes` processes on this node: the usable CPUs divided among them, at least 1."""
    return max(1, usable_cpus() // max(1, processes))


def busy_elsewhere(seconds=0.2):
    """How many of this process's usable CPUs other processes kept busy over the next `seconds` (in cores, e.g.
    1.7), or None where /proc/stat cannot say (not Linux). Read just before training starts, while this process
    is idle: a neighbour on a core makes every thread scheduled there wait for it."""
    import time

    with BusyMeter() as meter:
        time.sleep(seconds)
    return meter.busy


class BusyMeter:
    """`with BusyMeter() as m: <work>` - then `m.busy`: how many of this process's usable CPUs other processes kept
    busy while the work ran (in cores), or None where /proc/stat cannot say. The CPU time this process spent, on
    all its threads (an onnxruntime session's included), and that of the child processes it waited for (OpenVINO
    is timed in one) is not counted: what the CPUs did beyond it is."""

    def __enter__(self):
        import time

        self.busy = None
        self._before, self._own, self._t = _cpu_sample(), _own_cpu_seconds(), time.monotonic()
        return self

    def __exit__(self, *exc):
        import time

        after, own, seconds = _cpu_sample(), _own_cpu_seconds() - self._own, time.monotonic() - self._t
        before = self._before
        if not before or not after or seconds <= 0:
            return False
        cpus = [c for c in before if c in after]  # a CPU taken offline meanwhile is left out
        total = sum(after[c][0] - before[c][0] for c in cpus)
        idle = sum(after[c][1] - before[c][1] for c in cpus)
        if total > 0:
            self.busy = max(0.0, (total - idle) / total * len(cpus) - own / seconds)
        return False


def _own_cpu_seconds():
    """CPU seconds this process has used, all its threads, and its child processes that ended and were waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _cpu_sample():
    """{cpu: (all jiffies, idle + iowait jiffies)} of this process's usable CPUs from /proc/stat, or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3] != " "]
    except OSError:
        return None
    mine = usable_set()
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    return {int(p[0][3:]): (sum(map(int, p[1:9])), int(p[4]) + int(p[5])) for p in lines if int(p[0][3:]) in mine}


def usable_set():
    """The numbers of the CPUs this process may run on (its affinity mask; every CPU where there is none)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def threads_beside(threads, busy):
    """How many of `threads` threads to train on when other processes keep `busy` of our CPUs busy: the cores
    left free (at least 1), or `threads` when nothing is in the way (or /proc/stat could not say)."""
    if busy is None or threads <= 1 or busy < 0.5:
        return threads
    return max(1, min(threads, round(usable_cpus() - busy)))


def crowding_note(threads, busy):
    """What the run does beside busy neighbours, in words, or '' when it keeps `threads`."""
    free = threads_beside(threads, busy)
    if free >= threads:
        return ""
    return (f"other processes are keeping {busy:.1f} of this process's {usable_cpus()} CPUs busy: training on {free} "
            f"thread{'s' if free != 1 else ''} instead of {threads}, so that no step waits for a shared core (with "
            f"{threads}, every step waits for the busiest core: 8x slower beside one busy core, BENCHMARKS.md); set "
            "train.threads to choose the count yourself (the count moves the accuracies by a few images; runs at one "
            "count repeat exactly)")


MAX_AUTO_LOADER_WORKERS = 8
MIN_SHM_FOR_WORKERS = 2**30  # /dev/shm below it: no worker processes (they hand batches over through it)


def loader_workers(setting, device_type, local_world=1):
    """(DataLoader workers per training process, why) for train.num_workers = `setting`. null: none on a CPU -
    the training step needs every core, and on 2 cores an in-process loader is as fast (BENCHMARKS.md, "Decoding
    images once") - and on CUDA the process's share of the CPUs less one (its own), at most
    MAX_AUTO_LOADER_WORKERS: on one H200 the photos recipe's crops took 10 workers to reach 5-7k images/s, where
    one core cuts about 2k a second."""
    if setting is not None:
        return setting, "train.num_workers"
    if device_type != "cuda":
        return 0, "auto: CPU"
    if problem := socket_folder_problem():
        return 0, f"auto: CUDA, but {problem}"
    shm = shared_memory_bytes()
    if shm is not None and shm < MIN_SHM_FOR_WORKERS:  # workers hand batches over through it: a bus error
        return 0, (f"auto: CUDA, but /dev/shm holds only {shm / 2**20:.0f} MB, too little for worker processes' "
                   "batches; give it more (docker run --shm-size 8g) or set train.num_workers")
    share = cpu_share(local_world)
    return max(0, min(MAX_AUTO_LOADER_WORKERS, share - 1)), f"auto: CUDA, {share} CPUs for this process"


# A worker hands each batch over through a Unix socket at <temporary folder>/pymp-XXXXXXXX/listener-XXXXXXXX (32
# characters after the folder), and a socket path holds at most 107 bytes: past that the worker's send fails and
# the training process waits for the batch forever (Python before 3.14 does not fall back to /tmp).
MAX_SOCKET_PATH = 107
SOCKET_NAME_CHARS = 32


def socket_folder_problem(folder=None):
    """Why DataLoader worker processes cannot run with this temporary folder (its path too long for their sockets),
    or ''."""
    import tempfile

    folder = folder or tempfile.gettempdir()
    longest, length = MAX_SOCKET_PATH - SOCKET_NAME_CHARS, len(os.fsencode(folder))
    if length <= longest:
        return ""
    return (f"the temporary folder '{folder}' ($TMPDIR) is {length} characters long, too long for "
            f"the sockets worker processes hand batches over through (at most {longest}); set TMPDIR to a shorter "
            "folder, such as /tmp")


def shared_memory_bytes(path="/dev/shm"):
    """The size of the shared-memory file system DataLoader workers pass batches through, or None where there is
    none to read (not Linux)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_frsize * st.f_blocks
