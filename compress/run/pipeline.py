"""Run the requested stages in order, deciding for each: skip (done, nothing changed), resume (interrupted,
same config and inputs), or run fresh (new, --force, or something it depends on changed).

Order of work: check everything that can be checked (config against the world, run-dir ownership, manifest)
-> take the run-dir lock -> for each stage: decide, load and check its inputs, and only then write. Rank 0
decides and writes; the decision is broadcast so every rank does the same thing.
"""

import logging
import logging.handlers
import os
import shlex
import sys
import time

import yaml

from compress.data.imagefolder import listed_once
from compress.errors import (
    CTRL_C_STOP,
    EXIT_INTERRUPTED,
    CompressError,
    InputError,
    Interrupted,
    StageFailed,
    is_peer_loss,
    peer_loss_text,
)
from compress.fileio import SafeFormatter, open_append, sha256_file
from compress.run import preflight, schema
from compress.run.config import ConfigView, load_config, read_yaml
from compress.run.context import StageContext, pixel_place
from compress.run.contract import DIGESTS, LEFT_OUT, StageResult
from compress.run.report import write_report
from compress.run.rundir import RunDir, RunLock, lock_holder, now, versions
from compress.run.state import (
    ROOT_CHANGED,
    StageState,
    checkpoint_rel,
    config_drift,
    decide,
    missing_upstream,
    root_changed,
    stage_states,
)
from compress.torchrun import run_command
from compress.training import distributed as dist
from compress.training import interrupt
from stages import STAGES

log = logging.getLogger(__name__)

LOCK_ENV = "COMPRESS_RUN_LOCKED"  # set by `compress run --nproc-per-node`, which holds the lock for its workers


def run_pipeline(cfg, run_root, stage_names, force=False):
    """Run `stage_names` (canonical order) in `run_root`; returns {stage: result dict or None if skipped}.

    Nothing in the run directory changes until a stage has loaded and checked its inputs (`ctx.begin()`):
    a bad config, a missing or corrupt input, or a checkpoint of the wrong model leaves every file as it was.
    """
    run = RunDir(run_root)
    with interrupt.graceful_stop(), dist.process_group(cfg.train.device, cfg.train.threads) as env, listed_once():
        saved = dist.on_main(env, _check_before_writing, cfg, run, stage_names, env.world)
        with _run_lock(run, env), _RunLog(run, env) as run_log:
            writer = _ConfigWriter(run, cfg, saved, run_log)
            results, said_root = {}, False
            try:
                for name in stage_names:
                    interrupt.stop_if_asked(f"before the {name} stage", env)
                    state = StageState.from_json(dist.on_main(env, lambda n=name: decide(
                        run, cfg, STAGES[n], force, STAGES, env.world).to_json()))
                    if state.action == "skip":
                        if env.is_main:
                            log.info("%s: up to date, skipped (%s)", name, state.reason)
                            _record_new_digests(run, name, state.inputs)
                        results[name] = None
                        continue
                    if env.is_main and root_changed(state.reason) and not said_root:
                        log.warning("%s", ROOT_CHANGED)
                        said_root = True
                    if name == "teacher" and "distill" in stage_names and cfg.data.unlabeled:
                        _decode_unlabeled_first(run, cfg, env)
                    results[name] = _run_stage(run, cfg, env, STAGES[name], state, writer)
                interrupt.stop_if_asked("after the last stage; every finished stage is saved", env)
            except (StageFailed, Interrupted) as e:
                if env.is_main and run.exists():  # the report tells the whole story: what ran, and what failed
                    _report_quietly(run)
                if force and isinstance(e, Interrupted) and "rerun the same command to resume" in str(e):
                    # a checkpoint to resume from, which the same command (--force) would throw away
                    raise Interrupted(str(e).replace("rerun the same command to resume", "rerun the same command "
                                                     "without --force to resume", 1)) from None
                raise
            if env.is_main:
                results["report"] = write_report(run, STAGES)
                _say_what_went_stale(run, stage_names, read_config(run.config_path) if writer.wrote else None)
    return results


class _RunLog:
    """Rank 0's run log: every line of compress, and every warning of the libraries underneath (the terminal
    shows those only with -v), appended to the run's log.txt - but only once a stage begins writing, so a run
    refused for bad input leaves every file as it was. Until then (and for warnings raised before the run
    directory could be written: model checks) the lines wait in memory."""

    NAMES = ("compress", "stages", "py.warnings")

    def __init__(self, run, env):
        self.run, self.env, self.file = run, env, None
        self.held = logging.handlers.MemoryHandler(capacity=1_000_000, flushLevel=logging.CRITICAL + 1)
        # escaped like the terminal's lines: names read from files reach log.txt too, and `cat log.txt` shows it
        self.held.setFormatter(SafeFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    def __enter__(self):
        if self.env.is_main:
            for logger in map(logging.getLogger, self.NAMES):
                for early in [h for h in logger.handlers if isinstance(h, logging.handlers.MemoryHandler)]:
                    early.setTarget(self.held)
                    early.flush()
                    early.setTarget(None)
                    logger.removeHandler(early)
                logger.addHandler(self.held)
        return self

    def begin(self):
        """A stage is about to write: from now on the lines go to log.txt."""
        if self.env.is_main and self.file is None:
            self.file = _LogFile(open_append(self.run.path("log.txt"), "run log"))
            self.file.setFormatter(self.held.formatter)
            self.held.setTarget(self.file)
            self.held.flush()
            for logger in map(logging.getLogger, self.NAMES):
                logger.removeHandler(self.held)
                logger.addHandler(self.file)

    def __exit__(self, exc_type, exc, tb):
        if self.file is not None and exc is not None:  # why the run ended, as the terminal says it, kept with the run
            self.file.handle(_ending(exc))
        for logger in map(logging.getLogger, self.NAMES):
            for handler in (self.held, self.file):
                if handler is not None:
                    logger.removeHandler(handler)
        if self.file is not None:
            self.file.close()
        self.held.setTarget(None)
        self.held.close()


def _ending(exc):
    """The log record of the error or stop that ends a run, in the words the CLI prints on the terminal."""
    stopped = isinstance(exc, (Interrupted, KeyboardInterrupt)) or getattr(exc, "exit_code", None) == EXIT_INTERRUPTED
    if isinstance(exc, CompressError):
        text = str(exc)
    elif isinstance(exc, KeyboardInterrupt):
        text = CTRL_C_STOP
    elif is_peer_loss(exc):
        stopped, text = True, peer_loss_text(str(exc).strip().splitlines()[0] if str(exc).strip() else "")
    else:
        text = f"unexpected {type(exc).__name__}: {exc}"
    return logging.makeLogRecord({"name": "compress", "levelno": logging.WARNING if stopped else logging.ERROR,
                                  "levelname": "WARNING" if stopped else "ERROR",
                                  "msg": "%s: %s", "args": ("stopped" if stopped else "error", text)})


class _LogFile(logging.StreamHandler):
    """log.txt, opened by `open_append` (a pipe or a folder in its place is refused, never waited on). A line the
    disk refuses (full, gone read-only) is dropped with one warning on the terminal, not logging's traceback per
    line: the stage's own write then fails with the sentence that names the file."""

    def handleError(self, record):
        if self.stream is not None:
            self.stream = None  # before the warning: it comes back through this handler, which now skips it
            log.warning("log.txt cannot be written any more (%s); its lines from here on are shown only here",
                        sys.exc_info()[1])

    def emit(self, record):
        if self.stream is not None:
            super().emit(record)


def _report_quietly(run):
    try:
        write_report(run, STAGES)
    except Exception as e:  # the stage's own error is the one to show
        log.debug("no report after the failure: %s", e)


def read_config(path):
    """The config a run directory's config.yaml holds (as the next plain `compress run` there reads it), or None
    when it cannot be read back (then nothing is said about the stages left out; the run itself is done)."""
    try:
        return load_config(path, [], follow_links=False, run_config=True)
    except CompressError:
        return None


def _say_what_went_stale(run, stage_names, written_cfg):
    """After a partial run: the later stages that now read replaced files, and the command that refreshes them;
    and (`written_cfg`: the config a stage of this run wrote to the run's config.yaml) the stages left out that
    were made with another config - a `--set` for one stage is the run's config from now on."""
    states = stage_states(run, STAGES)
    stale = [name for name in STAGES if name not in stage_names and states[name][0] == "invalidated"]
    if stale:
        log.warning("%s now stale (%s); refresh with: %s --run-dir %s --stages %s", " and ".join(stale)
                    + (" are" if len(stale) > 1 else " is"), states[stale[0]][1], run_command(),
                    shlex.quote(str(run.root)), ",".join(stale))
    others = [name for name in STAGES if name not in stage_names and name not in stale]
    drift = config_drift(run, written_cfg, STAGES, others) if written_cfg is not None and others else []
    if drift:
        names, keys = [n for n, _ in drift], sorted({k for _, ks in drift for k in ks})
        log.warning("%s made with another config than the one %s now holds (%s): the next `compress run --run-dir "
                    "%s` runs %s again; to keep %s, set %s back (--set) or pass the config they were made with (-c)",
                    " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
                    + (" were" if len(names) > 1 else " was"), run.rel(run.config_path),
                    ", ".join(keys[:4]), run.root, "them" if len(names) > 1 else "it",
                    "them" if len(names) > 1 else "it", "those keys" if len(keys) > 1 else "that key")


def _check_before_writing(cfg, run, stage_names, world):
    """Everything checkable before a file is written; returns the run directory's saved config (raw YAML
    mapping) or None."""
    data = preflight.check(cfg, stage_names, world, run_root=run.root)
    check_run_dir(run, cfg, stage_names)
    for line in data["lines"]:
        log.info("%s", line)
    for note in data["notes"]:
        log.warning("data: %s", note)
    return read_yaml(run.config_path, follow_links=False) if os.path.isfile(run.config_path) else None


def _record_new_digests(run, name, inputs):
    """A stage that an older version recorded without the digests it did not follow (images, model code) is
    skipped for them once; they are recorded now, so a later change to the images or the code runs it again."""
    recorded = (run.manifest()["stages"].get(name) or {}).get("inputs", {})
    new = {k: v for k, v in inputs.items() if k.startswith(DIGESTS) and k not in recorded}
    if new:
        run.update_stage(name, inputs={**recorded, **new})


def _held_elsewhere(run):
    """Who else holds the run directory's lock ('' for nobody, and in `--nproc-per-node` workers, whose launcher
    holds it for them)."""
    return lock_holder(run) if os.environ.get(LOCK_ENV) != run.root else ""


def _busy_message(holder, run):
    return f"another compress run ({holder}) is using {run.root}; wait for it to finish or use another --run-dir"


def check_run_dir(run, cfg, stage_names, writing=True):
    """Refuse, before anything is written, a run directory that is not ours to write into (`writing`: one we cannot
    write to), a corrupt manifest, and a stage whose input neither the directory holds nor an earlier stage of this
    run writes."""
    run.check_usable(writing)
    for name in stage_names:  # a folder where a stage's file goes would fail it after its work, not now
        run.check_files([*STAGES[name].OUTPUTS.values(), *getattr(STAGES[name], "WRITES_TOO", ()),
                         *(checkpoint_rel(name, part) for part in getattr(STAGES[name], "PARTS", ()))])
    holder = _held_elsewhere(run) if writing else ""
    if holder:  # before the stages are read: one still running looks unfinished ("run the qat stage first")
        raise InputError(_busy_message(holder, run))
    missing = missing_upstream(run, cfg, stage_names, STAGES)  # reads the manifest: a corrupt one is refused here
    if missing:
        raise InputError(missing)


class _run_lock:
    """Rank 0 holds the run-dir lock for the whole run, unless the launcher (`--nproc-per-node`) holds it."""

    def __init__(self, run, env):
        self.run, self.env, self.lock = run, env, None

    def __enter__(self):
        held = os.environ.get(LOCK_ENV) == self.run.root

        def take():
            self.run.create()
            if not held:
                self.lock = RunLock(self.run).acquire()
        dist.on_main(self.env, take)
        return self

    def __exit__(self, *exc):
        if self.lock:
            self.lock.release()


class _ConfigWriter:
    """config.yaml holds each stage's keys as that stage last ran them: a stage that runs saves its keys (and
    the `train` section); the other stages' entries stay as they were."""

    def __init__(self, run, cfg, saved, run_log):
        self.run, self.cfg, self.run_log = run, cfg, run_log
        self.raw = saved if isinstance(saved, dict) else None
        self.wrote = False  # whether a stage of this run wrote config.yaml

    def stage_began(self, spec):
        self.wrote = True
        self.run_log.begin()
        new = schema.to_dict(self.cfg)
        if self.raw is None:
            self.raw = new
        else:
            kept = {key[len(LEFT_OUT):]: schema.get_path(self.raw, key[len(LEFT_OUT):], None)
                    for key in spec.CONFIG_KEYS if key.startswith(LEFT_OUT)}  # in a section it saves, not read by it
            for key in (*spec.CONFIG_KEYS, "train"):
                if not key.startswith(LEFT_OUT):
                    schema.set_path(self.raw, key, schema.get_path(new, key))
            for key, value in kept.items():  # as the stages that read it last ran it
                schema.set_path(self.raw, key, value)
        self.run.write_config(yaml.safe_dump(self.raw, sort_keys=False))


class _StageRun:
    """One stage's run: `begin` is called by the stage (every rank) once its inputs are loaded and checked."""

    def __init__(self, run, env, spec, state, writer):
        self.run, self.env, self.spec, self.state, self.writer = run, env, spec, state, writer
        self.begun = False
        self.start = time.perf_counter()
        self.earlier = 0.0  # a resumed stage's time in the runs it continues, counted in its total
        if state.action == "resume" and env.is_main:
            entry = run.manifest()["stages"].get(spec.NAME) or {}
            earlier = entry.get("seconds") if entry.get("status") in ("interrupted", "failed") else None
            self.earlier = float(earlier) if isinstance(earlier, (int, float)) else 0.0

    def begin(self):
        if self.begun:
            return
        self.begun = True
        if self.env.is_main:
            self.writer.stage_began(self.spec)
            d = self.state
            self.run.update_stage(self.spec.NAME, status="running", config_hash=d.config_hash, config=d.config,
                                  result_hash=d.result_hash, inputs=d.inputs, outputs={}, started=now(), finished=None,
                                  seconds=None,  # a completed run's time is not this one's (a kill -9 writes none)
                                  world_size=self.env.world, device=str(self.env.device), versions=versions(),
                                  message=None)
        if not self.spec.RANK0_ONLY:
            dist.barrier(self.env)

    def this_run(self):
        return round(time.perf_counter() - self.start, 2)

    def seconds(self):
        """The stage's time in all: this run's, and that of the interrupted runs it resumed."""
        return round(self.earlier + time.perf_counter() - self.start, 2)


def _decode_unlabeled_first(run, cfg, env):
    """data.unlabeled's images decoded into the pixel cache before the teacher trains, when the run goes on to
    distill (which reads them from there): a file that cannot be read is named now, not after the teacher's
    hours."""
    from compress.data.datasets import load_data

    if env.is_main:
        log.info("teacher: decoding data.unlabeled's images first (distill reads them after the teacher), so that "
                 "a file that cannot be read is named before the teacher trains")
    load_data(cfg.data, cfg.seed, unlabeled=True, place=pixel_place(run, cfg.data, env))
    interrupt.stop_if_asked("while decoding data.unlabeled's images (the chunks written so far are kept)", env,
                            what="go on")


def _run_stage(run, cfg, env, spec, stage_state, writer):
    name = spec.NAME
    if env.is_main:
        log.info("%s: %s", name, stage_state.headline)
    state = _StageRun(run, env, spec, stage_state, writer)
    ctx = StageContext(ConfigView(cfg, spec.CONFIG_KEYS), run, env, stage_state, begin=state.begin,
                       rank0_only=spec.RANK0_ONLY)
    try:
        if spec.RANK0_ONLY:
            result = StageResult(**dist.on_main(env, lambda: vars(spec.run(ctx))))
        else:
            result = spec.run(ctx)
    except BaseException as e:
        if env.is_main and state.begun:
            # a worker that lost its peers (one killed, a node gone) was cut off, not refused: resuming is the remedy
            cut_off = isinstance(e, (Interrupted, KeyboardInterrupt)) or (env.distributed and is_peer_loss(e))
            status = "interrupted" if cut_off else "failed"
            message = str(e) if isinstance(e, CompressError) else f"{e.__class__.__name__}: {e}"
            try:
                run.update_stage(name, status=status, finished=now(), message=message, seconds=state.seconds())
            except CompressError as unrecorded:  # the disk that failed the stage refuses this too: its error counts
                log.debug("the stage's end is not recorded: %s", unrecorded)
        raise
    state.begin()  # no-op when the stage called it, as stages do
    if env.is_main:
        this = state.this_run()  # the clock read once: the log and the manifest say the same time
        total = round(state.earlier + this, 2)
        outputs = {rel: sha256_file(run.path(rel)) for rel in result.outputs}
        worlds = ctx.world_sizes()  # resumed with another number of processes: every count, in order
        metrics = {**result.metrics, "world_sizes": worlds} if len(worlds) > 1 else result.metrics
        run.update_stage(name, status="complete", outputs=outputs, metrics=metrics, finished=now(),
                         seconds=total, resumed=stage_state.action == "resume")
        log.info("%s: done in %.1fs%s - %s", name, this,
                 f" ({total:.1f}s in all, with the run it resumed)" if state.earlier else "", result.summary)
    dist.barrier(env)
    return vars(result)


def plan(cfg, run_root, stage_names, force=False, world=1):
    """What `run_pipeline` would do, writing nothing: the data summary, then (stage, action, why) per stage,
    action being skip, run or resume. A stage whose upstream runs first runs too (its input will change)."""
    with listed_once():
        return _plan(cfg, RunDir(run_root), stage_names, force, world)


def _plan(cfg, run, stage_names, force, world):
    from compress.run.contract import Input

    data = preflight.check(cfg, stage_names, world, run_root=run.root, download=False)  # a dry run writes nothing
    holder = _held_elsewhere(run)
    try:
        check_run_dir(run, cfg, stage_names, writing=False)  # a dry run writes nothing: it plans a read-only run too
    except InputError:
        if holder:  # a stage that run is doing looks unfinished: say what is going on instead
            raise InputError(_busy_message(holder, run)) from None
        raise
    try:
        run.check_writable()
    except InputError as e:
        data = {**data, "unwritable": str(e)}
    if holder:
        data = {**data, "busy": holder}
    rows, running = [], {}
    for name in stage_names:
        spec = STAGES[name]
        upstream = [i for i in spec.inputs(ConfigView(cfg, spec.CONFIG_KEYS)) if isinstance(i, Input)
                    and i.stage in running]
        try:
            state = decide(run, cfg, spec, force, STAGES, world, planning=True, running_first=set(running))
            action, why = {"skip": "skip", "fresh": "run", "resume": "resume"}[state.action], state.reason
        except CompressError as e:  # an input not there yet: fine when the stage that writes it runs first
            if not upstream:
                raise
            action, why = "run", str(e)
        if upstream:  # whatever the files say now, its inputs are about to change
            upstream.sort(key=lambda i: list(STAGES).index(i.stage))
            stages_first = list(dict.fromkeys(i.stage for i in upstream))
            names, rels = _and(stages_first), [STAGES[i.stage].OUTPUTS[i.output] for i in upstream]
            s = "" if len(stages_first) > 1 else "s"  # the verb agrees with the stages, not with their files
            exists = all(os.path.isfile(run.path(rel)) for rel in rels)
            action, why = "run", (f"{names} run{s} first and replace{s} {_and(rels)}" if exists else
                                  f"after {names}, which write{s} {_and(rels)}")
        if action != "skip":
            running[name] = action
        rows.append((name, action, why))
    if any(root_changed(why) for _, action, why in rows if action == "run"):
        data.setdefault("advice", []).append(ROOT_CHANGED)
    return data, rows


def _and(items):
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]
