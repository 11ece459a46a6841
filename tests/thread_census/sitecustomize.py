"""Put on PYTHONPATH of a `compress run --nproc-per-node N` by tests/training/test_distributed.py: every torchrun worker
writes the names of its OS threads to $THREAD_CENSUS_DIR/rank<R>.txt at interpreter exit.

Registered at start-up, this atexit handler runs after every other one, i.e. right before the interpreter
begins to finalize: the threads it lists are the ones that will still be running while Python tears itself
down. A process group's gloo threads (pt_gloo_runloop, gloo_tcp_loop) in that list mean the group outlived
destroy_process_group()."""

import atexit
import os


def _census():
    out = os.environ.get("THREAD_CENSUS_DIR")
    if not out or "RANK" not in os.environ:  # the launcher itself has no rank
        return
    tasks = sorted(os.listdir("/proc/self/task"))
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    with open(os.path.join(out, f"rank{os.environ['RANK']}.txt"), "a") as f:
        f.write(" ".join(names) + "\n")


atexit.register(_census)
