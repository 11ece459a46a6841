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
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


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
