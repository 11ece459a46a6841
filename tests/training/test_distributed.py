"""Real DDP: 2 gloo processes on the CPU, launched by `compress run --nproc-per-node 2` and by torchrun."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from compress.training.checkpoint import read_weights
from compress.training.precision import cpu_bf16_support
from conftest import FAULTS, ROOT, compress_subprocess

pytestmark = pytest.mark.e2e

CENSUS = os.path.join(ROOT, "tests", "thread_census")
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _census_env(census):
    """Environment under which every torchrun worker lists its threads at exit (tests/thread_census)."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (CENSUS, os.environ.get("PYTHONPATH")) if p),
            "THREAD_CENSUS_DIR": str(census)}


def _assert_no_group_thread_at_exit(census, ranks=(0, 1)):
    for rank in ranks:
        lines = (census / f"rank{rank}.txt").read_text().splitlines()
        assert len(lines) == 1, lines  # one worker per rank, no restart
        left = [name for name in lines[0].split() if name in GLOO_THREADS]
        assert not left, f"rank {rank} exits with the process group's threads still running: {lines[0]}"


@pytest.fixture(scope="module")
def ddp_run(tiny_config, tmp_path_factory):
    """The whole pipeline in 2 processes; every worker lists its threads at exit."""
    run = tmp_path_factory.mktemp("ddp") / "run"
    census = tmp_path_factory.mktemp("census")
    scratch = tmp_path_factory.mktemp("tmpdir")  # the launcher's and the workers' temporary folder
    proc = compress_subprocess("run", "-c", tiny_config, "--run-dir", run, "--nproc-per-node", "2",
                               env={**_census_env(census), "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stderr, census, scratch


def test_two_processes_run_the_pipeline_with_identical_replicas(finished_run, ddp_run):
    run, stderr, _, _ = ddp_run
    manifest = json.loads((run / "manifest.json").read_text())["stages"]
    assert all(manifest[s]["world_size"] == 2 for s in ("teacher", "distill", "qat", "export"))
    # every parameter identical across ranks after training; after the freeze epochs, every observer,
    # fake-quant and BN buffer too (checked by the stages themselves, against rank 0's copy)
    assert manifest["teacher"]["metrics"]["replicas_identical"] is True
    assert manifest["distill"]["metrics"]["replicas_identical"] is True  # hint regressor included
    assert manifest["qat"]["metrics"]["buffers_identical"] is True
    # in bf16 autocast where the CPU computes bf16 natively (train.precision: auto), fp32 elsewhere
    for stage in ("teacher", "distill"):
        assert manifest[stage]["metrics"]["precision"] == ("bf16" if cpu_bf16_support() else "fp32"), stage
    for rel in ("teacher/model.safetensors", "distill/model.safetensors", "qat/qat.safetensors"):
        tensors, _ = read_weights(run / rel)
        assert not any(k.startswith("module.") for k in tensors), rel
    # rank 0 alone logs and writes
    assert stderr.count("teacher: epoch 1/2") == 1
    assert len(json.loads((run / "teacher" / "metrics.json").read_text())["epochs"]) == 2
    # same global batch as the 1-process run: comparable accuracy
    single = json.loads((finished_run / "manifest.json").read_text())["stages"]
    for stage, key in (("teacher", "val_acc"), ("distill", "val_acc"), ("qat", "int8_acc")):
        assert abs(manifest[stage]["metrics"][key] - single[stage]["metrics"][key]) < 6.0, stage


def test_a_multi_process_run_leaves_nothing_in_the_temporary_folder(ddp_run):
    """torch's elastic agent keeps a folder per start (/tmp/torchelastic_*) that it never removes; the launcher
    asks it for none, so a run writes only into its run directory."""
    assert sorted(os.listdir(ddp_run[3])) == []


def test_no_process_group_thread_is_left_running_when_a_worker_exits(ddp_run):
    """A gloo group's threads still running at interpreter exit are what a worker can die of after a complete
    stage ("terminate called without an active exception"). The census runs after every other exit handler,
    so this is the state the interpreter finalizes in: the group must be gone by then, its threads joined."""
    _assert_no_group_thread_at_exit(ddp_run[2])


def kill_rank_1(tiny_config, run, tmp_path, restarts):
    """The teacher stage on 2 processes launched by torchrun, rank 1 killed (-9) at its 6th step."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
         str(restarts), "--log-dir", str(tmp_path / "elastic"), FAULTS, "run", "-c", tiny_config, "--run-dir",
         str(run), "--stages", "teacher"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COMPRESS_FAULT": "teacher:1:6:kill:1"})


def test_a_lost_worker_restarts_the_group_which_resumes_identically(ddp_run, tiny_config, tmp_path):
    """kill -9 of rank 1 mid-epoch; --max-restarts 1 restarts both workers, which resume from the last
    checkpoint and end with the weights of the uninterrupted 2-process run."""
    reference, _, _, _ = ddp_run
    run = tmp_path / "lost"
    proc = kill_rank_1(tiny_config, run, tmp_path, restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lost contact with another process of the run" in proc.stderr and "resuming" in proc.stderr
    assert "the launcher restarts the group (1 restart(s) left)" in proc.stderr, proc.stderr[-3000:]
    # rank 0 records the stage as cut off, not failed: no advice to change a setting
    assert "resuming the interrupted run" in proc.stderr and "the last run failed" not in proc.stderr, \
        proc.stderr[-3000:]
    a, _ = read_weights(reference / "teacher" / "model.safetensors")
    b, _ = read_weights(run / "teacher" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_worker_that_loses_its_peer_exits_as_interrupted_not_failed(tiny_config, tmp_path):
    """kill -9 of rank 1 without restarts: rank 0 loses contact, says so in one line and exits 130 (interrupted,
    as the stage is recorded and resumed), not 1 (a stage that failed its own check)."""
    run = tmp_path / "lost"
    proc = kill_rank_1(tiny_config, run, tmp_path, restarts=0)
    assert proc.returncode != 0
    line = next(x for x in proc.stderr.splitlines() if "lost contact" in x)
    assert line.startswith("stopped [rank 0]: lost contact with another process of the run (it stopped, crashed or "
                           "was killed; "), line
    assert ".cc:" not in line and "rerun the same command to resume" in line, line
    last = (run / "log.txt").read_text().strip().splitlines()[-1]  # the run's log ends as the terminal does
    assert "WARNING stopped: lost contact with another process of the run (it stopped, crashed or was killed; " \
        in last and ".cc:" not in last, last
    assert re.search(r"exitcode\s*: 130 \(pid", proc.stderr), proc.stderr[-3000:]
    assert json.loads((run / "manifest.json").read_text())["stages"]["teacher"]["status"] == "interrupted"


def test_a_replica_that_drifts_fails_the_stage(tiny_config, tmp_path):
    """The replica check compares every tensor with rank 0's: a parameter nudged on rank 1 alone after one
    update (DDP never re-sends parameters, so the replicas stay apart) fails the stage, naming the tensor."""
    run = tmp_path / "drift"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--log-dir",
         str(tmp_path / "elastic"), FAULTS, "run", "-c", tiny_config, "--run-dir", str(run), "--stages", "teacher",
         "--set", "teacher.epochs=1"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COMPRESS_FAULT": "teacher:0:3:perturb:1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "teacher: ranks disagree on 1 tensors after training (stem.0.weight); DDP went out of sync" in proc.stderr
    assert json.loads((run / "manifest.json").read_text())["stages"]["teacher"]["status"] == "failed"


def test_torchrun_launch_trains_the_teacher(tiny_config, tmp_path):
    run = tmp_path / "torchrun"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--log-dir", str(tmp_path / "elastic"), "-m", "compress", "run", "-c", tiny_config, "--run-dir", str(run),
         "--stages", "teacher",
         "--set", "teacher.epochs=1", "--set", "data.augment=none"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())["stages"]["teacher"]
    assert manifest["status"] == "complete" and manifest["world_size"] == 2
    assert manifest["metrics"]["val_acc"] > 50.0


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_machine_train_as_one_group(tiny_config, tmp_path):
    """Two torchrun launchers ("nodes") on localhost, one process each, meeting through c10d rendezvous: the
    recipe for real nodes, with 127.0.0.1 standing in for the first node's address and a shared run dir."""
    run = tmp_path / "two-nodes"
    census = tmp_path / "census"
    census.mkdir()
    port = _free_port()

    def node(rank):
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"compress-{tmp_path.name}", "--log-dir", str(tmp_path / f"elastic{rank}"), "-m", "compress",
             "run", "-c", tiny_config, "--run-dir", str(run),
             "--stages", "teacher,distill", "--set", "teacher.epochs=1", "--set", "distill.epochs=1",
             # two "nodes" share this machine's cores: one thread each, as each would have its own cores
             "--set", "train.threads=1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **_census_env(census)})

    launchers = [node(0), node(1)]
    outputs = [p.communicate(timeout=600) for p in launchers]
    for p, (_, err) in zip(launchers, outputs):
        assert p.returncode == 0, err[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())["stages"]
    for stage in ("teacher", "distill"):
        assert manifest[stage]["status"] == "complete" and manifest[stage]["world_size"] == 2
        assert manifest[stage]["metrics"]["replicas_identical"] is True
    # one set of files, written once (by global rank 0)
    files = sorted({str(p.parent.relative_to(run)) + "/events" if "tfevents" in p.name else str(p.relative_to(run))
                    for p in run.rglob("*") if p.is_file()})
    board = ["distill/baseline/tensorboard/events", "distill/tensorboard/events", "teacher/tensorboard/events"]
    assert [f for f in files if not f.endswith("/events")] == [
        "config.yaml", "distill/baseline.safetensors", "distill/baseline/last/checkpoint.safetensors",
        "distill/baseline/metrics.json", "distill/last/checkpoint.safetensors", "distill/metrics.json",
        "distill/model.safetensors", "log.txt", "manifest.json", "report.json", "report.md", "report.png",
        "teacher/last/checkpoint.safetensors", "teacher/metrics.json", "teacher/model.safetensors"]
    assert [f for f in files if f.endswith("/events")] in ([], board)  # TensorBoard is an optional extra
    _assert_no_group_thread_at_exit(census)  # each node's worker tore its group down


def test_clipping_under_two_processes_keeps_the_replicas_identical(tiny_config, tmp_path):
    """The gradients are averaged over the ranks before they are clipped, so every rank scales them alike and the
    replicas stay one model (2 real gloo processes; a tight clip so it acts on every step). train.threads set to
    every usable CPU in each of the 2 processes: more threads than CPUs, said once."""
    import json

    from compress.cpus import usable_cpus
    from conftest import compress_subprocess

    run, cpus = tmp_path / "run", usable_cpus()
    proc = compress_subprocess("run", "-c", tiny_config, "--run-dir", run, "--stages", "teacher", "--nproc-per-node",
                               "2", "--set", "train.clip_grad_norm=0.05", "--set", "teacher.epochs=1", "--set",
                               f"train.threads={cpus}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count(f"train.threads={cpus} in each of 2 processes is {2 * cpus} threads on {cpus} usable "
                             "CPUs: they wait for each other") == 1, proc.stderr[-3000:]
    metrics = json.loads((run / "manifest.json").read_text())["stages"]["teacher"]["metrics"]
    assert metrics["replicas_identical"] is True


def _processes_naming(text):
    """PIDs of the processes whose command line holds `text` (from /proc: no pgrep needed)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    return env.get(b"RANK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the workers' environment from /proc")
def test_max_restarts_restarts_the_group_when_a_worker_is_killed(tiny_config, tmp_path):
    """kill -9 of rank 1 under `compress run --nproc-per-node 2 --max-restarts 1 --force`: the launcher says so,
    starts both processes again, they resume from the last checkpoint (--force applies to the first start only)
    and the stage completes (exit 0)."""
    import time

    run = tmp_path / "restarted"
    exe = os.path.join(os.path.dirname(sys.executable), "compress")
    launcher = subprocess.Popen([exe, "run", "-c", tiny_config, "--run-dir", str(run), "--stages", "teacher",
                                 "--set", "teacher.epochs=4", "--nproc-per-node", "2", "--max-restarts", "1",
                                 "--force"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 300
        while not ((run / "log.txt").exists() and "teacher: epoch 1/" in (run / "log.txt").read_text()):
            assert time.time() < deadline and launcher.poll() is None, "the run did not start training"
            time.sleep(0.2)
        (victim,) = [pid for pid in _processes_naming(str(run)) if _rank_of(pid) == b"1"]
        os.kill(victim, 9)
        _, stderr = launcher.communicate(timeout=600)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    assert "a worker was killed (SIGKILL); restarting the 2 processes (1 of 1), which resume from the last " \
           "checkpoint" in stderr
    assert "resuming" in stderr and stderr.count("running (--force)") == 1, stderr[-3000:]
    assert json.loads((run / "manifest.json").read_text())["stages"]["teacher"]["status"] == "complete"


def test_max_restarts_does_not_restart_on_bad_input(tmp_path):
    """An image that cannot be decoded is found by the workers (they decode the images): a restart would only
    print the same error again, so the launcher stops at the first, with the input error's exit code."""
    from conftest import images

    root = tmp_path / "photos"
    for split, n in (("train", 8), ("val", 2)):
        for c, name in enumerate(("cat", "dog")):
            images(root / split / name, n, shade=100 * c + (50 if split == "val" else 0), size=16)
    (root / "train" / "cat" / "broken.png").write_bytes(b"not an image")
    proc = compress_subprocess("run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--nproc-per-node", "2",
                               "--max-restarts", "2", "--set", "data.name=imagefolder", "--set", f"data.root={root}",
                               "--set", "data.image_size=16", "--set", "model.teacher=compact_cnn", "--set",
                               "teacher.epochs=1", "--set", "teacher.batch_size=4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("broken.png") == 1, proc.stderr[-3000:]
    assert "restarting" not in proc.stderr


def test_max_restarts_does_not_restart_a_stage_that_failed_its_own_check(run_copy):
    """A stage that ran and failed its check (exit 1: here export, int8 required 100x faster) would fail the same
    way again: said once, not retried."""
    proc = compress_subprocess("run", "--run-dir", run_copy, "--stages", "export", "--nproc-per-node", "2",
                               "--max-restarts", "2", "--set", "export.require_faster_int8=true", "--set",
                               "export.min_int8_speedup=100")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("error: export:") == 1 and "restarting" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_stop_and_checkpoint_when_their_launcher_is_killed(tiny_config, tmp_path):
    """kill -9 of `compress run --nproc-per-node 2` forwards no signal to its workers (each in a session of its
    own): they are sent SIGTERM by the kernel, checkpoint and exit, instead of training on unseen and unlocked."""
    import time

    run = tmp_path / "orphans"
    exe = os.path.join(os.path.dirname(sys.executable), "compress")
    launcher = subprocess.Popen([exe, "run", "-c", tiny_config, "--run-dir", str(run), "--stages", "teacher",
                                 "--set", "teacher.epochs=200", "--nproc-per-node", "2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not ((run / "log.txt").exists() and "teacher: epoch 1/" in (run / "log.txt").read_text()):
            assert time.time() < deadline and launcher.poll() is None, "the run did not start training"
            time.sleep(0.5)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.time() + 120
    while _processes_naming(str(run)) and time.time() < deadline:
        time.sleep(0.5)
    left = _processes_naming(str(run))
    for pid in left:
        os.kill(pid, 9)
    assert not left, "workers kept running after their launcher was killed"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["teacher"]["status"] == "interrupted"
    assert (run / "teacher" / "last" / "checkpoint.safetensors").is_file()


def test_a_two_process_rerun_suggests_its_refresh_in_two_processes_and_meets_without_a_waiting_line(run_copy):
    """The command a worker suggests keeps the launcher's --nproc-per-node (pasted, it trains as this run did);
    processes of one machine meet at once, so the rendezvous wait is not announced."""
    proc = compress_subprocess("run", "--run-dir", run_copy, "--stages", "distill", "--set", "distill.epochs=1",
                               "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"refresh with: compress run --nproc-per-node 2 --run-dir {run_copy} --stages qat,export"
            in proc.stderr), proc.stderr[-3000:]
    assert "waiting for the other" not in proc.stderr


def test_the_suggested_command_is_launched_as_this_run_was():
    from compress.torchrun import NPROC_ENV, run_command

    assert run_command({NPROC_ENV: "4"}) == "compress run --nproc-per-node 4"
    assert run_command({NPROC_ENV: "1"}) == run_command({}) == run_command({NPROC_ENV: "x"}) == "compress run"
    by_hand = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    assert run_command(by_hand) == "compress run --nproc-per-node 4"  # torchrun on one node: the same launch
    assert run_command({**by_hand, "LOCAL_WORLD_SIZE": "2"}) == "torchrun ... -m compress run"  # two nodes
    assert run_command({"RANK": "1"}) == "compress run"  # a stray RANK is no launch


def test_a_stage_resumed_on_another_number_of_processes_records_both_counts(tiny_config, tmp_path):
    """Ctrl-C on one process, resumed on two: the manifest, `compress show` and the checkpoint keep both counts
    (the log alone said so), since the count moves the result like another seed's."""
    from conftest import fault_subprocess

    run = tmp_path / "run"
    args = ["run", "-c", tiny_config, "--run-dir", run, "--stages", "teacher"]
    stopped = fault_subprocess(*args, fault="teacher:1:5:sigint")
    assert stopped.returncode == 130, stopped.stderr
    resumed = compress_subprocess(*args, "--nproc-per-node", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert "written by 1 process, resumed by 2" in resumed.stderr
    metrics = json.loads((run / "manifest.json").read_text())["stages"]["teacher"]["metrics"]
    assert metrics["world_sizes"] == [1, 2], metrics
    shown = compress_subprocess("show", run)
    assert re.search(r"teacher  complete  \d+\.\ds, 1, then 2 process\(es\)", shown.stdout), shown.stdout
