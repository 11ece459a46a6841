"""`compress show` and `compress report`: looking at a run directory."""

import os

import click

from compress.cli.base import cli, debug_option

DEFAULT_RUN = "artifacts/default"


def _existing_run(run_dir):
    from compress.run.rundir import RunDir

    if run_dir is None:
        if not os.path.isfile(os.path.join(DEFAULT_RUN, "manifest.json")):
            raise click.BadParameter(f"no run directory given, and {DEFAULT_RUN} holds no run; pass one, e.g. "
                                     "compress show artifacts/cifar10", param_hint="RUN_DIR")
        run_dir = DEFAULT_RUN
    run = RunDir(run_dir)
    if not run.exists():
        raise click.BadParameter(f"'{run_dir}' is not a compress run directory (no manifest.json)",
                                 param_hint="RUN_DIR")
    return run


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False), required=False)
@debug_option
def show(run_dir):
    """Status of every stage in a run directory (default: artifacts/default), its key metrics, and its files
    checked against sha256.

    \b
    Example:
      compress show artifacts/default
    """
    from compress.run.rundir import file_check, lock_holder
    from compress.run.state import stage_states
    from stages import STAGES

    run = _existing_run(run_dir)
    manifest = run.manifest()
    states = stage_states(run, STAGES, manifest)
    holder = lock_holder(run)
    click.echo(f"run {run.root}" + (f" (another compress run is using it now: {holder})" if holder else ""))
    for name in STAGES:
        state, detail = states[name]
        entry = manifest["stages"].get(name) or {}
        if holder and entry.get("status") == "running":  # not interrupted: it is the stage that run is doing
            state, detail = "running now", f"{holder}, since {entry.get('started', '?')}"
        line = f"{name:8} {state}" + (f" ({detail})" if detail else "")
        if entry.get("seconds") is not None and state != "not run":
            line += f"  {entry['seconds']:.1f}s, {entry.get('world_size', 1)} process(es)"
        click.echo(line)
        metrics = entry.get("metrics") or {}
        shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if shown and state in ("complete", "invalidated"):
            click.echo("         " + ", ".join(f"{k} {_short(v)}" for k, v in list(shown.items())[:6]))
        for rel, sha in (entry.get("outputs") or {}).items():
            click.echo(f"         {file_check(run, rel, sha):9} {rel}")


def _short(value):
    return f"{value:.4g}" if isinstance(value, float) else f"{value:,}"


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False), required=False)
@debug_option
def report(run_dir):
    """Write report.md, report.json and report.png for a run directory (default: artifacts/default) and print
    the table.

    \b
    Example:
      compress report artifacts/default
    """
    from compress.run.report import build_rows, markdown_table, write_report
    from compress.run.rundir import RunLock
    from stages import STAGES

    run = _existing_run(run_dir)
    with RunLock(run):
        click.echo(markdown_table(write_report(run, STAGES)))
    for note in build_rows(run, STAGES)[1]:
        click.echo(f"- {note}")
    click.echo(f"report: {run.path('report.md')}")
