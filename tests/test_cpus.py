"""The CPU count and default training threads (compress.cpus): the affinity mask, not the machine, and the
user's OMP_NUM_THREADS honoured where torchrun did not set it."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from compress.cpus import ELASTIC_WORKER_ENV, MAX_AUTO_LOADER_WORKERS, loader_workers, training_threads, usable_cpus
from conftest import invoke


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="affinity masks are Linux-only")
def test_the_cpu_count_is_what_the_process_may_run_on_not_the_machine():
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " \
           "from compress.cpus import usable_cpus, training_threads; print(usable_cpus(), training_threads()[0])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["1", "1"]
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_omp_num_threads_is_honoured_unless_torchrun_set_it():
    cpus = usable_cpus()
    assert training_threads(1, {"OMP_NUM_THREADS": "1"}) == (1, "OMP_NUM_THREADS")
    assert training_threads(1, {}) == (cpus, f"{cpus} usable CPUs")
    assert training_threads(1, {"OMP_NUM_THREADS": "zero"})[0] == cpus  # not a count: ignored
    # a torchrun worker: its OMP_NUM_THREADS=1 is torchrun's default, so each process takes its share
    worker = {"OMP_NUM_THREADS": "1", ELASTIC_WORKER_ENV: "x"}
    assert training_threads(2, worker) == (max(1, cpus // 2), f"{cpus} usable CPUs / 2 processes")


def test_dataloader_workers_default_to_none_on_a_cpu_and_feed_a_gpu_from_the_processes_cpus():
    code = "import os; os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:{n}])); " \
           "from compress.cpus import loader_workers; print(loader_workers(None, 'cuda', {world})[0])"
    run = lambda n, world: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code.format(n=n, world=world)], capture_output=True, text=True, check=True).stdout
    assert run(1, 1).strip() == "0"  # one CPU: the process itself needs it
    if usable_cpus() >= 2:
        assert run(2, 1).strip() == "1"
        assert run(2, 2).strip() == "0"  # 2 processes on 2 CPUs: one each, none left for workers
    cpus = usable_cpus()
    assert loader_workers(None, "cuda", 1) == (min(MAX_AUTO_LOADER_WORKERS, cpus - 1), f"auto: CUDA, {cpus} CPUs for "
                                                                                       "this process")
    assert loader_workers(None, "cpu", 1) == (0, "auto: CPU")
    assert loader_workers(3, "cpu", 1) == (3, "train.num_workers") == loader_workers(3, "cuda", 4)


def test_a_containers_small_dev_shm_keeps_the_gpu_default_to_no_workers(monkeypatch):
    """Workers hand batches over through /dev/shm; Docker's default 64 MB would end in a bus error."""
    import compress.cpus

    monkeypatch.setattr(compress.cpus, "shared_memory_bytes", lambda path="/dev/shm": 64 * 2**20)
    workers, why = loader_workers(None, "cuda", 1)
    assert workers == 0 and "/dev/shm holds only 64 MB" in why and "--shm-size" in why
    assert loader_workers(4, "cuda", 1) == (4, "train.num_workers")  # a count the user chose is theirs
    monkeypatch.setattr(compress.cpus, "shared_memory_bytes", lambda path="/dev/shm": 8 * 2**30)
    assert loader_workers(None, "cuda", 1)[0] == min(MAX_AUTO_LOADER_WORKERS, usable_cpus() - 1)


def test_a_temporary_folder_too_long_for_the_workers_sockets_is_refused_or_avoided(monkeypatch, tmp_path):
    """Workers hand batches over through sockets at $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX; a socket path holds
    107 bytes, and past that the training process waited forever for its first batch. The default falls back to no
    workers and says why; a count the user set is refused before anything is written."""
    import tempfile

    import compress.cpus
    from compress.run import preflight
    from compress.run.config import load_config

    fits, too_long = "/tmp/" + "x" * 70, "/tmp/" + "x" * 71  # 75 and 76 characters
    assert compress.cpus.socket_folder_problem(fits) == ""
    assert compress.cpus.socket_folder_problem(too_long) == (
        f"the temporary folder '{too_long}' ($TMPDIR) is 76 characters long, too long for the sockets worker "
        "processes hand batches over through (at most 75); set TMPDIR to a shorter folder, such as /tmp")
    monkeypatch.setattr(compress.cpus, "shared_memory_bytes", lambda path="/dev/shm": 8 * 2**30)
    monkeypatch.setattr(tempfile, "tempdir", too_long)
    workers, why = loader_workers(None, "cuda", 1)
    assert workers == 0 and why.startswith("auto: CUDA, but the temporary folder") and "set TMPDIR" in why
    cfg = load_config(None, ["train.num_workers=2"])
    assert "train.num_workers: DataLoader worker processes cannot run here: the temporary folder " \
        f"'{too_long}' ($TMPDIR) is 76 characters long" in " ".join(preflight.problems(cfg, ["teacher"], 1))
    assert not [p for p in preflight.problems(cfg, ["export"], 1) if "num_workers" in p]  # no worker there
    monkeypatch.setattr(tempfile, "tempdir", fits)
    assert not [p for p in preflight.problems(cfg, ["teacher"], 1) if "num_workers" in p]


@pytest.mark.e2e
def test_a_run_takes_the_users_omp_num_threads_and_says_so(tmp_path, tiny_config):
    from conftest import compress_subprocess

    run = tmp_path / "run"
    proc = compress_subprocess("run", "-c", tiny_config, "--run-dir", run, "--stages", "teacher", "--set",
                               "teacher.epochs=1", "--set", "data.limit=64", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "on 1 (OMP_NUM_THREADS) CPU thread(s) per process, 0 DataLoader worker(s) (auto: CPU)" in (
        run / "log.txt").read_text()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="/proc/stat is Linux-only")
def test_a_busy_neighbour_is_seen_and_named_with_the_thread_count_that_avoids_it():
    """A process spinning on one of our CPUs is counted (a lower bound: other load only adds) and named with the
    thread count that avoids it: beside a busy process the default 2 threads can run 8x slower."""
    from compress.cpus import busy_elsewhere, crowding_note

    spin = "import time\nt = time.time()\nwhile time.time() - t < 4: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", spin])
    try:
        import time

        time.sleep(0.8)  # the interpreter has started and is spinning
        busy = busy_elsewhere(0.5)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert busy is not None and busy >= 0.6, busy
    cpus = usable_cpus()
    assert crowding_note(cpus, None) == "" and crowding_note(1, 5.0) == "" and crowding_note(cpus, 0.3) == ""
    if cpus >= 2:
        note = crowding_note(cpus, cpus - 0.9)  # all but about one CPU taken
        assert f"keeping {cpus - 0.9:.1f} of this process's {cpus} CPUs busy: training on 1 thread instead of " \
               f"{cpus}" in note
        assert note.endswith("set train.threads to choose the count yourself (the count moves the accuracies by a few "
                             "images; runs at one count repeat exactly)")


@pytest.mark.e2e
@pytest.mark.skipif(not os.path.exists("/proc/stat") or usable_cpus() < 2, reason="needs /proc/stat and 2 CPUs")
def test_a_run_that_chose_its_own_thread_count_trains_on_the_free_cores_and_one_told_a_count_does_not(
        tiny_config, tmp_path):
    from conftest import compress_subprocess

    spin = "import time\nt = time.time()\nwhile time.time() - t < 60: pass"
    neighbours = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(usable_cpus() - 1)]  # 1 CPU free
    try:
        runs = {}
        for name, omp in (("ours", ""), ("told", "2")):  # "": no count given, so compress chooses one per CPU
            runs[name] = compress_subprocess("run", "-c", tiny_config, "--run-dir", tmp_path / name, "--stages",
                                             "teacher", "--set", "teacher.epochs=1", "--set", "data.limit=100",
                                             env={"OMP_NUM_THREADS": omp})
    finally:
        for n in neighbours:
            n.kill()
            n.wait()
    assert runs["ours"].returncode == 0 and runs["told"].returncode == 0, runs["ours"].stderr + runs["told"].stderr
    warning = [line for line in runs["ours"].stderr.splitlines() if "other processes are keeping" in line]
    assert len(warning) == 1 and warning[0].endswith("set train.threads to choose the count yourself (the count "
                                                     "moves the accuracies by a few images; runs at one count repeat "
                                                     "exactly)"), runs["ours"].stderr
    assert "teacher: trains in" in runs["ours"].stderr  # applied, not only advised
    assert "on 1 (the CPUs other processes leave free) CPU thread(s)" in runs["ours"].stderr
    assert "other processes" not in runs["told"].stderr  # OMP_NUM_THREADS=2 was the user's choice
    assert "other processes are keeping" in (tmp_path / "ours" / "log.txt").read_text()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="/proc/stat is Linux-only")
def test_the_busy_meter_counts_neighbours_not_this_process_or_the_children_it_waits_for():
    """Timing work runs in this process (onnxruntime's threads) and in child processes it waits for (OpenVINO's):
    neither is a busy neighbour; a process spinning beside it is."""
    from compress.cpus import BusyMeter, _own_cpu_seconds

    before = _own_cpu_seconds()  # a child that spins for 0.6 s of its own CPU time (os.times counts in 10 ms ticks)
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.6: pass"], check=True)
    assert _own_cpu_seconds() - before >= 0.5  # counted as this process's: subtracted from what the CPUs did
    spin = "import time\nt = time.time()\nwhile time.time() - t < {}: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", spin.format(3.0)])
    try:
        time.sleep(0.5)
        with BusyMeter() as beside:
            time.sleep(1.0)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert beside.busy is not None and beside.busy >= 0.6, beside.busy  # other load only adds to it


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_export_says_its_timings_are_noisy_beside_a_busy_neighbour_and_shows_every_runtime(run_copy):
    """Beside a busy process export says its timings are noisy (a busy machine can make the table say 1.08x and the
    verdict 2.07x), and every runtime timed, OpenVINO included, is shown."""
    spin = "import time\nt = time.time()\nwhile time.time() - t < 60: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.8)  # the interpreter has started and is spinning
        result = invoke("run", "--run-dir", run_copy, "--stages", "export", "--force")
    finally:
        neighbour.kill()
        neighbour.wait()
    assert result.exit_code == 0, result.output
    assert "so the latency figures (the table and the int8-vs-fp32 verdict) are noisy; time the files again on a " \
           f"quiet machine: compress bench {run_copy / 'export' / 'model.fp32.onnx'}" in result.stderr
    metrics = json.loads((run_copy / "manifest.json").read_text())["stages"]["export"]["metrics"]
    assert metrics["cpus_busy_while_timing"] >= 0.5
    report = (run_copy / "report.md").read_text()
    assert "- Other processes kept " in report
    others = metrics["runtimes"][1:]  # the runtimes timed beside onnxruntime: OpenVINO where it is installed
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("OpenVINO is not installed (the test extras install it): the report's line for a second runtime "
                    "is not checked (the rest of this test passed)")
    assert "openvino" in others, f"OpenVINO is installed, yet export timed only {metrics['runtimes']}"
    for runtime in others:
        t = metrics["other_runtimes"][runtime]
        assert f"- In {'OpenVINO' if runtime == 'openvino' else runtime} (batch {t['batch']}, {t['threads']} " \
               f"threads): int8 {t['int8']:.3f} ms against fp32 {t['fp32']:.3f} ms" in report
