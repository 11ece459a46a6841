"""The `compress` command line. Commands are thin: they parse, then call one library function."""

import logging
import os
import sys

import click

from compress import __version__
from compress.errors import EXIT_INTERRUPTED, CompressError

log = logging.getLogger("compress")

STAGE_ORDER = ("teacher", "distill", "qat", "export")  # kept equal to stages.ORDER by a test; importing
# `stages` here would import torch, and `compress --help` should answer instantly

_debug = {"on": bool(os.environ.get("COMPRESS_DEBUG"))}


def _set_debug(ctx, param, value):
    if value:
        _debug["on"] = True
    return value


debug_option = click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
                            help="Show full tracebacks for errors.")


def setup_logging(rank=0):
    handler = logging.StreamHandler(sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
    for name in ("compress", "stages"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        logger.propagate = False


class CompressGroup(click.Group):
    """Turns errors into one line on stderr and an exit code; tracebacks only with --debug."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except CompressError as e:
            if _debug["on"]:
                raise
            from compress.dist import MirroredError

            rank = int(os.environ.get("RANK", 0))
            if not isinstance(e, MirroredError):  # rank 0 already said it
                click.echo(f"error: {e}" if rank == 0 else f"error [rank {rank}]: {e}", err=True)
            ctx.exit(e.exit_code)
        except BrokenPipeError:  # `compress ... | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except KeyboardInterrupt:
            if _debug["on"]:
                raise
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except Exception as e:
            if _debug["on"]:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            if "RANK" in os.environ and _is_peer_loss(e):
                click.echo(f"error [rank {os.environ['RANK']}]: lost contact with another worker ({first[:160]}); "
                           "with --max-restarts N torchrun restarts the group, which resumes from the last "
                           "checkpoint", err=True)
            else:
                click.echo(f"error: unexpected {e.__class__.__name__}: {first} (rerun with --debug for the "
                           "traceback)", err=True)
            ctx.exit(1)


def _is_peer_loss(e):
    text = str(e)
    return type(e).__module__.startswith("torch.distributed") or any(
        marker in text for marker in ("gloo", "NCCL", "Connection reset", "Connection closed by peer"))


@click.group(cls=CompressGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="compress")
@debug_option
def cli():
    """compress: a training set in, a small, fast, verified int8 ONNX model out.

    \b
    Stages (each reads the previous one's files from the run directory):
      teacher   train a large model under DDP
      distill   train a small student from the teacher (KD, cosine, FitNets hint)
      qat       quantization-aware fine-tuning, prepare_qat_fx / convert_fx
      export    float and int8 ONNX, verified with onnxruntime

    \b
    Example:
      compress run                                  # all four stages, default config (offline MNIST)
      compress run --stages teacher --set teacher.epochs=5
      compress run --nproc-per-node 2               # 2 DDP processes (gloo on CPU, nccl on GPU)
      compress show artifacts/default
    """


def parse_stages(value):
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [n for n in names if n not in STAGE_ORDER]
    if unknown or not names:
        raise click.BadParameter(f"unknown stage '{unknown[0] if unknown else value}'; valid stages: "
                                 f"{', '.join(STAGE_ORDER)} (comma-separated)", param_hint="--stages")
    return [s for s in STAGE_ORDER if s in names]


def resolve_run_dir(run_dir, name, config_path):
    if run_dir:
        return run_dir
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "default"
    return os.path.join("artifacts", name or stem)


@cli.command()
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False),
              help="YAML config. Default: the run directory's config.yaml if it has one, else the built-in "
                   "defaults (configs/default.yaml).")
@click.option("--stages", "stages", default=",".join(STAGE_ORDER), show_default=True,
              help="Comma-separated stages to run; they always run in pipeline order.")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Where outputs go. Default: artifacts/<name>.")
@click.option("--name", help="Run name under artifacts/ (default: the config file's name, or 'default').")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value, e.g. --set teacher.epochs=5 (repeatable).")
@click.option("--nproc-per-node", type=click.IntRange(1), default=1, show_default=True,
              help="Processes on this node; >1 re-launches through torchrun (DDP).")
@click.option("--max-restarts", type=click.IntRange(0), default=0, show_default=True,
              help="With --nproc-per-node: restart the worker group this many times if a worker dies; "
                   "restarted workers resume from the last checkpoint.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="Overrides train.device.")
@click.option("--force", is_flag=True, help="Redo the selected stages even if they are up to date.")
@debug_option
def run(config_path, stages, run_dir, name, overrides, nproc_per_node, max_restarts, device, force):
    """Run pipeline stages: skip what is up to date, resume what was interrupted.

    \b
    Examples:
      compress run                                      # teacher, distill, qat, export
      compress run --stages teacher,distill -c configs/default.yaml
      compress run --stages qat --set qat.epochs=3      # rerun one stage from the previous output
      compress run --nproc-per-node 2 --max-restarts 1  # 2 processes; survive a lost worker
      torchrun --nproc_per_node 2 -m compress run       # the same, launched by hand (or multi-node)
    """
    from compress.config import load_config
    from compress.dist import launched_by_torchrun

    stage_names = parse_stages(stages)
    run_dir = resolve_run_dir(run_dir, name, config_path)
    if not config_path and os.path.isfile(os.path.join(run_dir, "config.yaml")):
        config_path = os.path.join(run_dir, "config.yaml")
    overrides = list(overrides) + ([f"train.device={device}"] if device else [])
    try:
        cfg = load_config(config_path, overrides)
    except CompressError as e:  # every torchrun worker parses the same config: let rank 0 alone say so
        from compress.dist import MirroredError

        raise e if int(os.environ.get("RANK", 0)) == 0 else MirroredError(str(e), e.exit_code)
    if nproc_per_node > 1 and not launched_by_torchrun():
        from compress.launch import relaunch

        argv = ["run", "--stages", ",".join(stage_names), "--run-dir", run_dir]
        argv += (["--config", config_path] if config_path else []) + (["--force"] if force else [])
        argv += [a for o in overrides for a in ("--set", o)] + (["--debug"] if _debug["on"] else [])
        click.echo(f"compress: starting {nproc_per_node} processes (torchrun)", err=True)
        sys.exit(relaunch(nproc_per_node, max_restarts, argv))
    from compress.pipeline import run_pipeline

    rank = int(os.environ.get("RANK", 0))
    setup_logging(rank)
    if config_path and rank == 0:
        log.info("config %s, run directory %s", config_path, run_dir)
    # a worker restarted by torchrun after losing a peer resumes instead of redoing forced stages
    force = force and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
    results = run_pipeline(cfg, run_dir, stage_names, force=force)
    if rank == 0 and results.get("report"):
        from compress.report import markdown_table

        click.echo(markdown_table(results["report"]))
        click.echo(f"report: {os.path.join(run_dir, 'report.md')}")


@cli.command("stages")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Also show each stage's status in this run.")
@debug_option
def stages_cmd(run_dir):
    """List the stages, what each reads and writes, and (with --run-dir) their status.

    \b
    Example:
      compress stages --run-dir artifacts/default
    """
    from compress.config import Config
    from compress.pipeline import stage_status
    from compress.rundir import RunDir
    from stages import STAGES

    cfg = Config()
    run = RunDir(run_dir) if run_dir else None
    if run and not os.path.isdir(run.root):
        raise click.BadParameter(f"'{run_dir}' does not exist", param_hint="--run-dir")
    manifest = run.manifest() if run else None
    for name in STAGE_ORDER:
        spec = STAGES.get(name)
        if spec is None:
            click.echo(f"{name:8} (not built yet)")
            continue
        reads = ", ".join(rel for _, rel in spec.inputs(cfg)) or "the dataset"
        line = f"{name:8} {spec.SUMMARY}\n         reads:  {reads}\n         writes: {', '.join(spec.OUTPUTS)}"
        if run:
            state, detail = stage_status(run, spec, manifest)
            line += f"\n         status: {state}" + (f" ({detail})" if detail else "")
        click.echo(line)


@cli.command("config")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="YAML config to resolve.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a value (repeatable).")
@click.option("--reference", is_flag=True, help="Print every key with its type, default and meaning (Markdown).")
@debug_option
def config_cmd(config_path, overrides, reference):
    """Validate a config and print it resolved (defaults filled in, overrides applied).

    \b
    Examples:
      compress config -c configs/cifar10-tutorial.yaml --set distill.epochs=2
      compress config --reference
    """
    from compress.config import Config, dump_config, load_config

    if reference:
        from compress.schema import reference as rows

        click.echo("| key | type | default | meaning |\n|---|---|---|---|")
        for key, tp, default, help_text in rows(Config):
            click.echo(f"| `{key}` | {tp} | `{_yaml_value(default)}` | {help_text} |")
        return
    click.echo(dump_config(load_config(config_path, overrides)), nl=False)


def _yaml_value(value):
    import json

    return "null" if value is None else json.dumps(value) if not isinstance(value, str) else value


@cli.command("models")
def models_cmd():
    """List the model and dataset registries (names to use in model.* and data.name).

    \b
    Example:
      compress models
    """
    from compress.data import DATASETS
    from compress.models import DESCRIPTIONS

    click.echo("models:")
    for name, text in DESCRIPTIONS.items():
        click.echo(f"  {name:26} {text}")
    click.echo("datasets: " + ", ".join(DATASETS))


def _int_list(value, name):
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        items = []
    if not items or min(items) < 1:
        raise click.BadParameter(f"expected comma-separated positive whole numbers, got '{value}'", param_hint=name)
    return items


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.argument("images", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--top-k", type=click.IntRange(1), default=3, show_default=True, help="Classes to show per image.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@debug_option
def predict(model, images, top_k, as_json):
    """Classify image files with an exported ONNX model (onnxruntime + numpy + Pillow only).

    Preprocessing (size, channels, mean/std) and class names are read from the model file.

    \b
    Example:
      compress predict artifacts/default/export/model.int8.onnx digit1.png digit2.png
    """
    from compress.deploy import OnnxModel

    results = OnnxModel(model).predict(list(images), top_k=top_k)
    if as_json:
        import json

        click.echo(json.dumps([{"image": path, "top": [{"class": c, "probability": round(p, 6)} for c, p in top]}
                               for path, top in results], indent=2))
        return
    for path, top in results:
        click.echo(f"{path}: " + ", ".join(f"{c} ({p:.1%})" for c, p in top))


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--batch", default="1,64", show_default=True, help="Comma-separated batch sizes.")
@click.option("--threads", default=None, help="Comma-separated thread counts [default: 1,<all cores>].")
@click.option("--repeats", type=click.IntRange(1), default=30, show_default=True, help="Timed runs per cell.")
@click.option("--warmup", type=click.IntRange(0), default=5, show_default=True, help="Untimed runs first.")
@debug_option
def bench(model, batch, threads, repeats, warmup):
    """Time an ONNX model with onnxruntime: median latency per batch size and thread count.

    \b
    Example:
      compress bench artifacts/default/export/model.int8.onnx --batch 1,64 --threads 1,2
    """
    from compress.deploy import OnnxModel, latency_table

    OnnxModel(model, require_metadata=False)  # a clear error for a missing or non-ONNX file
    thread_list = _int_list(threads, "--threads") if threads else None
    rows = latency_table(model, _int_list(batch, "--batch"), thread_list, repeats, warmup)
    click.echo(f"{model} (onnxruntime, CPU, median of {repeats})")
    click.echo(f"{'batch':>6} {'threads':>8} {'ms':>10} {'images/s':>12}")
    for r in rows:
        click.echo(f"{r['batch']:>6} {r['threads']:>8} {r['ms']:>10.3f} {r['images_per_s']:>12,.0f}")


def _existing_run(run_dir):
    from compress.rundir import RunDir

    run = RunDir(run_dir)
    if not run.exists():
        raise click.BadParameter(f"'{run_dir}' is not a compress run directory (no manifest.json)",
                                 param_hint="RUN_DIR")
    return run


@cli.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@debug_option
def show(run_dir):
    """Status of every stage in a run directory, its key metrics, and its files checked against sha256.

    \b
    Example:
      compress show artifacts/default
    """
    from compress.pipeline import stage_status
    from compress.rundir import file_check
    from stages import STAGES

    run = _existing_run(run_dir)
    manifest = run.manifest()
    click.echo(f"run {run.root}")
    for name, spec in STAGES.items():
        state, detail = stage_status(run, spec, manifest)
        entry = manifest["stages"].get(name) or {}
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
@click.argument("run_dir", type=click.Path(file_okay=False))
@debug_option
def report(run_dir):
    """Write report.md, report.json and report.png for a run directory and print the table.

    \b
    Example:
      compress report artifacts/default
    """
    from compress.report import markdown_table, write_report

    run = _existing_run(run_dir)
    click.echo(markdown_table(write_report(run)))
    click.echo(f"report: {run.path('report.md')}")


COMMANDS = {"run": run, "stages": stages_cmd, "config": config_cmd, "models": models_cmd, "predict": predict,
            "bench": bench, "show": show, "report": report}


def main(argv=None):
    cli.main(args=argv, prog_name="compress")


if __name__ == "__main__":
    main()
