"""`compress show` and `compress report`: looking at a run directory."""

import os

import click

from compress.cli.base import cli, debug_option, echo
from compress.fileio import one_line

DEFAULT_RUN = "artifacts/default"


def _existing_run(run_dir, command):
    """The run directory `compress <command>` looks at, or one line saying why there is none (as predict and eval
    say it: no usage block)."""
    from compress.deploy.evaluate import run_hint, runs_here
    from compress.errors import InputError
    from compress.run.rundir import RunDir

    if run_dir is None:
        if not os.path.isfile(os.path.join(DEFAULT_RUN, "manifest.json")):
            found = runs_here()
            if found:
                more = f" and {len(found) - 5} more" if len(found) > 5 else ""
                raise InputError(f"no run directory given, and {DEFAULT_RUN} holds no run; pass one, e.g. "
                                 f"compress {command} {found[0]} (runs here, the latest first: "
                                 f"{', '.join(found[:5])}{more})")
            raise InputError(f"no run directory given, and there is no run in {os.path.dirname(DEFAULT_RUN)}/ here; "
                             f"pass the folder a run wrote (its --run-dir): compress {command} RUN_DIR")
        run_dir = DEFAULT_RUN
    run = RunDir(run_dir)
    if not run.exists():
        if os.path.lexists(run.manifest_path):  # a folder, pipe or link where the manifest should be
            raise InputError(f"'{run.manifest_path}' is not a regular file (a folder, pipe, device or link); replace "
                             "it with the run's manifest, or move it away")
        if not os.path.lexists(run_dir):
            raise InputError(f"'{run_dir}' does not exist{run_hint(run_dir)}")
        raise InputError(f"'{run_dir}' is not a compress run directory (no manifest.json){run_hint(run_dir)}")
    return run


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False), required=False)
@debug_option
def show(run_dir):
    """Status of every stage in a run directory (default: artifacts/default), its key metrics, and its files
    checked against sha256. Read from the run directory alone: whether your images, weights files or code changed
    since is what `compress run --dry-run` checks.

    \b
    Example:
      compress show artifacts/default
    """
    from compress.run.rundir import file_check, lock_holder
    from compress.run.state import stage_states
    from stages import STAGES

    run = _existing_run(run_dir, "show")
    manifest = run.manifest()
    states = stage_states(run, STAGES, manifest)
    drift = _config_drift(run)
    holder = lock_holder(run)
    echo(f"run {run.root}" + (f" (another compress run is using it now: {holder})" if holder else ""))
    for name in STAGES:
        state, detail = states[name]
        entry = manifest["stages"].get(name) or {}
        if holder and entry.get("status") == "running":  # not interrupted: it is the stage that run is doing
            state, detail = "running now", f"{holder}, since {entry.get('started', '?')}"
        line = f"{name:8} {state}" + (f" ({one_line(detail)})" if detail else "")
        if entry.get("seconds") is not None and state != "not run":
            line += f"  {entry['seconds']:.1f}s, {_processes(entry)} process(es)"
        echo(line)
        if name in drift:
            echo(f"         config.yaml changed since it ran ({', '.join(drift[name][:4])}): the next `compress run "
                 f"--run-dir {run.root}` runs it again (`--dry-run` shows the plan)")
        metrics = entry.get("metrics") or {}
        shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if shown and state in ("complete", "invalidated"):
            echo("         " + ", ".join(f"{k} {_short(v)}" for k, v in list(shown.items())[:6]))
        for rel, sha in (entry.get("outputs") or {}).items():
            echo(f"         {file_check(run, rel, sha):10} {rel}")
    _show_results(run, STAGES, states, manifest)


def _config_drift(run):
    """{stage: [config keys]} of the completed stages the run's config.yaml, edited since, would run again; {} when
    it cannot be read (`compress run` says why)."""
    from compress.errors import CompressError
    from compress.run.config import load_config
    from compress.run.state import config_drift
    from stages import STAGES

    if not os.path.isfile(run.config_path):
        return {}
    try:
        cfg = load_config(run.config_path, run_config=True, follow_links=False)
        return dict(config_drift(run, cfg, STAGES, list(STAGES)))
    except (CompressError, TypeError, ValueError, AttributeError, KeyError):  # a manifest edited by hand
        return {}


def _show_results(run, stages, states, manifest):
    """Every artifact's accuracy, size and latency (the report's rows: the student alone and PTQ among them),
    and the export verdict - or what keeps it from being read, or that export.json changed since export wrote it."""
    from compress.deploy import export_report
    from compress.errors import CompressError
    from compress.run.report import build_rows, text_table
    from compress.run.state import files_changed

    rows, notes = build_rows(run, stages)
    if rows:
        echo("")
        for line in text_table(rows):
            echo(f"  {line}")
    for note in notes:
        if "damaged" in note:
            echo(f"  {note}")
    state = states.get("export", ("",))[0]
    if state not in ("complete", "invalidated", "failed"):
        return
    try:
        verdict = export_report.read(run.root, "verdict")
        export_report.deployment_file(run.root, verdict.file, "verdict.file")
    except CompressError as error:
        echo(f"deploy: cannot tell - {error}")
        return
    why = [] if state == "complete" else [f"the verdict of an export now {state}"]
    recorded = (manifest["stages"].get("export") or {}).get("outputs", {})
    if files_changed(run, recorded, [f"export/{export_report.FILE}"]):  # its verdict is no longer export's own
        why.append("from an export.json changed since export wrote it")
    said = f"deploy ({', '.join(why)})" if why else "deploy"
    echo(f"{said} export/{verdict.file}: {verdict.why}")
    chance = ((manifest["stages"].get("export") or {}).get("metrics") or {}).get("near_chance")
    if chance and isinstance(chance, str):
        echo(f"warning: {one_line(chance)}")


def _processes(entry):
    """'2' or, for a stage resumed with another number of processes, '2, then 1'."""
    worlds = (entry.get("metrics") or {}).get("world_sizes")
    if isinstance(worlds, list) and len(worlds) > 1 and all(type(w) is int for w in worlds):
        return ", then ".join(str(w) for w in worlds)
    return str(entry.get("world_size", 1))


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

    run = _existing_run(run_dir, "report")
    with RunLock(run):
        echo(markdown_table(write_report(run, STAGES)))
    for note in build_rows(run, STAGES)[1]:
        echo(f"- {note}")
    echo(f"report: {run.path('report.md')}")
