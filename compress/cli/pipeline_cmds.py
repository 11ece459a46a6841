"""`compress run`, `stages`, `config`, `models`: running the pipeline and describing it."""

import os
import sys

import click

from compress.cli.base import _debug, cli, debug_option, echo, log, setup_logging, verbose_option
from compress.errors import CompressError, InputError
from stages import ORDER as STAGE_ORDER  # the names only: importing them loads no torch, so --help is instant


def parse_stages(value):
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [n for n in names if n not in STAGE_ORDER]
    if unknown or not names:
        import difflib

        close = difflib.get_close_matches(unknown[0], STAGE_ORDER, n=1) if unknown else []
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise click.BadParameter(f"unknown stage '{unknown[0] if unknown else value}'{hint}; valid stages: "
                                 f"{', '.join(STAGE_ORDER)} (comma-separated)", param_hint="--stages")
    return [s for s in STAGE_ORDER if s in names]


def resolve_run_dir(run_dir, name, config_path):
    if run_dir and name:  # both name the run directory: one must win, so neither does
        raise click.UsageError(f"--name {name} and --run-dir {run_dir} both say where the run goes; give one (--name "
                               f"X is --run-dir artifacts/X)")
    if run_dir:
        return run_dir
    if name is not None and (not name.strip() or name in (".", "..") or "/" in name or os.sep in name
                             or any(ord(c) < 32 or ord(c) == 127 for c in name)):
        raise click.BadParameter(f"{name!r} is not a run name: give one folder name under artifacts/ (letters, "
                                 "digits, - and _), or a path with --run-dir", param_hint="--name")
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "default"
    return os.path.join("artifacts", name or stem)


def _config_source(config_path, run_dir, overrides):
    """(config file, whether it is the run directory's own): -c as given, else the run's config.yaml - read as it
    is, never through a link (it is printed back in errors) - else the defaults (None)."""
    if config_path:
        return config_path, False
    if os.path.lexists(os.path.join(run_dir, "config.yaml")):
        return os.path.join(run_dir, "config.yaml"), True
    if not overrides and os.path.isdir(os.path.join(run_dir, "cache", "pixels")) and \
            not os.path.lexists(os.path.join(run_dir, "manifest.json")):
        raise InputError(f"'{run_dir}' holds only the images a first run decoded before it stopped, not its config: "
                         "rerun that run's command, with its -c and --set (the defaults would train on the built-in "
                         "digits)")
    return None, False


@cli.command()
@click.option("-c", "--config", "config_path",
              help="YAML config file, or the name of a shipped recipe (compress config --list: default, cifar10, "
                   "...). Default: the run directory's config.yaml if it has one, else the built-in defaults.")
@click.option("--stages", "stages", multiple=True,
              help=f"Comma-separated stages to run (repeatable: --stages teacher --stages qat is teacher,qat); they "
                   f"always run in pipeline order.  [default: {','.join(STAGE_ORDER)}]")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Where outputs go. Default: artifacts/<name>.")
@click.option("--name", help="Run name under artifacts/ (default: the config file's name, or 'default').")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value, e.g. --set teacher.epochs=5 (repeatable).")
@click.option("--nproc-per-node", type=click.IntRange(1), default=1, show_default=True,
              help="Processes on this node; >1 re-launches through torchrun (DDP).")
@click.option("--max-restarts", type=click.IntRange(0), default=0, show_default=True,
              help="With --nproc-per-node: restart the worker group this many times if a worker dies; "
                   "restarted workers resume from the last checkpoint (an error is not retried).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="Overrides train.device.")
@click.option("--force", is_flag=True, help="Redo the selected stages even if they are up to date.")
@click.option("--dry-run", is_flag=True,
              help="Say what each stage would do (run, skip, resume, and why); write nothing.")
@verbose_option
@debug_option
def run(config_path, stages, run_dir, name, overrides, nproc_per_node, max_restarts, device, force, dry_run):
    """Run pipeline stages: skip what is up to date, resume what was interrupted.

    \b
    Examples:
      compress run                                      # teacher, distill, qat, export
      compress run --stages teacher,distill -c configs/default.yaml
      compress run --stages qat --set qat.epochs=3      # rerun one stage from the previous output
      compress run --nproc-per-node 2 --max-restarts 1  # 2 processes; survive a lost worker
      compress run -c photos --set data.root=~/photos --dry-run    # the plan, nothing written
      torchrun --nproc_per_node 2 -m compress run       # the same, launched by hand (or multi-node)
    """
    from compress.run import recipes
    from compress.torchrun import env_rank, launched_by_torchrun

    stage_names = parse_stages(",".join(stages) if stages else ",".join(STAGE_ORDER))
    run_dir = resolve_run_dir(run_dir, name, config_path)
    config_path, note = recipes.resolve(config_path)
    config_path, own_config = _config_source(config_path, run_dir, overrides)
    overrides = list(overrides) + ([f"train.device={device}"] if device else [])
    cfg = _load_run_config(config_path, overrides, run_dir, own_config)
    if dry_run:
        return _dry_run(cfg, config_path, note, run_dir, stage_names, force, nproc_per_node)
    if nproc_per_node > 1 and not launched_by_torchrun():
        sys.exit(_relaunch(cfg, config_path, stage_names, run_dir, overrides, force, nproc_per_node, max_restarts))
    from compress.run.pipeline import run_pipeline

    if launched_by_torchrun():
        from compress.training.distributed import die_with_launcher

        die_with_launcher()
    rank = env_rank()
    setup_logging(rank)
    if config_path and rank == 0:
        log.info("config %s, run directory %s", config_path, run_dir)
        if note:
            log.info("%s", note)
    from compress.run.launch import first_attempt

    results = run_pipeline(cfg, run_dir, stage_names, force=force and first_attempt())
    if rank == 0 and results.get("report"):
        from compress.run.report import markdown_table

        try:
            echo(markdown_table(results["report"]))
            echo(f"report: {os.path.join(run_dir, 'report.md')}")
        except CompressError as e:  # the run is done and its table written: not printing it fails nothing
            log.warning("the run is complete, but its table was not printed (%s); it is in %s", str(e).split(";")[0],
                        os.path.join(run_dir, "report.md"))


def _load_run_config(config_path, overrides, run_dir, own_config):
    """The run's config (`own_config`: the run directory's config.yaml, whose folder must be a run's). Every
    torchrun worker parses the same config: a bad one is said by rank 0 alone."""
    from compress.run.config import load_config

    try:
        if own_config:  # another program's folder is named as such, not by its config.yaml's keys
            from compress.run.rundir import RunDir

            run = RunDir(run_dir)
            run.check_usable(writing=False)
            run.manifest()
        return load_config(config_path, overrides, follow_links=not own_config, run_config=own_config)
    except CompressError as e:
        from compress.errors import MirroredError
        from compress.torchrun import env_rank

        raise e if env_rank() == 0 else MirroredError(str(e), e.exit_code)


def _dry_run(cfg, config_path, note, run_dir, stage_names, force, world):
    from compress.run.pipeline import plan

    data, rows = plan(cfg, run_dir, stage_names, force, world)
    echo(f"dry run: nothing is written. config {config_path or 'the defaults'}, run directory {run_dir}"
               + (f" ({note})" if note else ""))
    for line in data["lines"]:
        echo(line)
    for line in data["notes"]:
        echo(f"data: {line}")
    for line in data.get("weights", ()):
        echo(f"note: {line}")
    for name, action, why in rows:
        echo(f"{name:8} {action:7} {why}")
    for line in data.get("advice", ()):
        echo(f"note: {line}")
    if data.get("busy"):
        echo(f"note: another compress run ({data['busy']}) is using {run_dir} now: this plan is of its files "
                   "at this moment, and a `compress run` there stops until that run has ended")
    if data.get("unwritable"):  # the plan is still worth showing; the exit code says the run would not go
        raise InputError(f"{data['unwritable']} - `compress run` would stop here, before the plan above")


def _relaunch(cfg, config_path, stage_names, run_dir, overrides, force, nproc, max_restarts):
    """Check everything here, hold the run-dir lock for the workers, and start them through torchrun."""
    from compress.run import preflight
    from compress.run.launch import relaunch
    from compress.run.pipeline import LOCK_ENV, check_run_dir
    from compress.run.rundir import RunDir, RunLock

    run = RunDir(run_dir)
    preflight.check(cfg, stage_names, nproc, run_root=run.root)  # e.g. a batch that does not split: before workers
    check_run_dir(run, cfg, stage_names)
    run.create()
    argv = ["run", "--stages", ",".join(stage_names), "--run-dir", run_dir]
    argv += (["--config", config_path] if config_path else []) + (["--force"] if force else [])
    argv += [a for o in overrides for a in ("--set", o)] + (["--debug"] if _debug["on"] else [])
    argv += ["--verbose"] if _debug.get("verbose") else []
    with RunLock(run):
        os.environ[LOCK_ENV] = run.root  # the workers' run_pipeline: this process holds the lock for them
        try:
            echo(f"compress: starting {nproc} processes (torchrun)", err=True)
            return relaunch(nproc, max_restarts, argv)
        finally:  # a later run in this process (tests call the CLI in-process) must take the lock itself
            os.environ.pop(LOCK_ENV, None)


@cli.command("stages")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Also show each stage's status in this run.")
@debug_option
def stages_cmd(run_dir):
    """List the stages, what each reads and writes, and (with --run-dir) their status.

    \b
    Example:
      compress stages --run-dir artifacts/default
    """
    from compress.deploy.evaluate import run_hint
    from compress.run.config import Config
    from compress.run.rundir import RunDir
    from compress.run.state import stage_states
    from stages import STAGES

    cfg = Config()
    run = RunDir(run_dir) if run_dir else None
    if run and not os.path.isdir(run.root):
        raise click.BadParameter(f"'{run_dir}' does not exist{run_hint(run_dir)}", param_hint="--run-dir")
    if run and not run.exists():  # every stage "not run" would read as a run that has not started
        raise click.BadParameter(f"'{run_dir}' is not a compress run directory (no manifest.json)",
                                 param_hint="--run-dir")
    states = stage_states(run, STAGES) if run else None
    for name in STAGE_ORDER:
        spec = STAGES[name]
        reads = ", ".join(_reads(i, STAGES) for i in spec.inputs(cfg)) or "the dataset"
        writes = ", ".join(spec.OUTPUTS.values())
        line = f"{name:8} {spec.SUMMARY}\n         reads:  {reads}\n         writes: {writes}"
        if run:
            state, detail = states[name]
            line += f"\n         status: {state}" + (f" ({detail})" if detail else "")
        echo(line)


@cli.command("config")
@click.option("-c", "--config", "config_path", help="YAML config file or shipped recipe name to resolve.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a value (repeatable).")
@click.option("--reference", is_flag=True, help="Print every key with its type, default and meaning (Markdown).")
@click.option("--list", "list_recipes", is_flag=True, help="List the shipped recipes (usable as -c NAME anywhere).")
@debug_option
def config_cmd(config_path, overrides, reference, list_recipes):
    """Validate a config and print it resolved (defaults filled in, overrides applied).

    \b
    Examples:
      compress config -c cifar10-tutorial --set distill.epochs=2
      compress config --list
      compress config --reference
    """
    from compress.run import recipes
    from compress.run.config import Config, dump_config, load_config

    given = [flag for flag, on in (("--reference", reference), ("--list", list_recipes),
                                   ("-c/--set", config_path or overrides)) if on]
    if len(given) > 1:  # each prints something else: one would be dropped without a word
        raise click.UsageError(f"{' and '.join(given)} each print something else; give one")
    if list_recipes:
        for name in recipes.names():
            echo(f"{name:22} {recipes.summary(name)}")
        return
    config_path, _ = recipes.resolve(config_path)

    if reference:
        from compress.run.schema import reference as rows

        echo("| key | type | default | meaning |\n|---|---|---|---|")
        for key, tp, default, help_text in rows(Config):
            echo(f"| `{key}` | {tp} | `{_yaml_value(default)}` | {help_text} |")
        return
    echo(dump_config(load_config(config_path, overrides)), nl=False)


def _yaml_value(value):
    import json

    return "null" if value is None else json.dumps(value) if not isinstance(value, str) else value


@cli.command("models")
@debug_option
def models_cmd():
    """List the model and dataset registries (names to use in model.* and data.name).

    \b
    Example:
      compress models
    """
    from compress.data.registry import DATASETS
    from compress.models.registry import DESCRIPTIONS, SOURCES

    echo("models:")
    for name, text in DESCRIPTIONS.items():
        echo(f"  {name:26} {text}")
    for key, source in SOURCES.items():
        if key != "registry":  # its names are the ones above
            echo(f"  {source.syntax:26} {source.summary}")
    echo("datasets (data.name):")
    for name, dataset in DATASETS.items():
        echo(f"  {name:26} {dataset.description}")


def _reads(item, stages):
    """What one declared input of a stage is, in words for `compress stages`."""
    from compress.run.contract import Code, Images, Input

    if isinstance(item, Input):
        return stages[item.stage].OUTPUTS[item.output] + ("" if item.required else " (optional)")
    if isinstance(item, Images):
        return ("the dataset (its files in data.root for an image folder)" if item.key == "root"
                else f"the images in data.{item.key}")
    if isinstance(item, Code):
        return f"the code of {item.key} (when it is yours)"
    return f"{item.key} ({item.path})"
