"""The click group, its error handling (one line per error, tracebacks only with --debug) and logging."""

import logging
import logging.handlers
import os
import sys
import traceback

import click

from compress import __version__
from compress.errors import CTRL_C_STOP, EXIT_INTERRUPTED, CompressError, Interrupted, is_peer_loss, peer_loss_text
from compress.fileio import SafeFormatter, safe_text, write_problem

log = logging.getLogger("compress")

_debug = {"on": bool(os.environ.get("COMPRESS_DEBUG")), "verbose": False}
class _Held(logging.handlers.MemoryHandler):
    """Lines kept in memory until a run's log.txt takes them (compress.run.pipeline._RunLog), at most `capacity`
    of them: a command that never opens a run log keeps the first lines and drops the rest."""

    def __init__(self, capacity):
        super().__init__(capacity, flushLevel=logging.CRITICAL + 1)

    def shouldFlush(self, record):
        return False

    def emit(self, record):
        if len(self.buffer) < self.capacity:
            self.buffer.append(record)


# library warnings raised before the run directory can be written (model checks in preflight) wait here
_EARLY = _Held(capacity=100_000)


def _set_debug(ctx, param, value):
    if value:
        _debug["on"] = True
    return value


debug_option = click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
                            help="Show full tracebacks for errors.")


def _set_verbose(ctx, param, value):
    if value:
        _debug["verbose"] = True
    return value


verbose_option = click.option("-v", "--verbose", is_flag=True, expose_value=False, is_eager=True,
                              callback=_set_verbose, help="Also show the warnings of the libraries compress uses "
                                                          "(always kept in the run's log.txt).")


def setup_logging(rank=0):
    """compress's own lines on stderr (rank 0: progress and results; other ranks: warnings only). Warnings of
    the libraries underneath (PyTorch quantization, ONNX export, ...) are routed through logging as well: into
    the run's log.txt (`log_to_file`), and onto the terminal only with -v or --debug."""
    handler = logging.StreamHandler(sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    # every line escaped (SafeFormatter): file, folder and class names, and messages read from files, reach the
    # terminal through log calls everywhere; one formatter leaves no call site to forget
    handler.setFormatter(SafeFormatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
    early = _Held(capacity=10_000) if rank == 0 else None  # the lines before the run log opens: config, data
    for name in ("compress", "stages"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler] + ([early] if early else [])
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        logger.propagate = False
    logging.captureWarnings(True)
    warnings_log = logging.getLogger("py.warnings")
    warnings_log.propagate = False
    warnings_log.setLevel(logging.WARNING)
    loud = _debug["on"] or _debug.get("verbose")
    warnings_log.handlers[:] = [handler] if loud and rank == 0 else [_EARLY]


class CompressGroup(click.Group):
    """Turns errors into one line on stderr and an exit code; tracebacks only with --debug."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.exceptions.ClickException as e:  # click prints it: the values a user typed, escaped
            e.message = safe_text(e.message)
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except CompressError as e:
            stopped = isinstance(e, Interrupted) or e.exit_code == EXIT_INTERRUPTED
            if _debug["on"] and not stopped:
                raise
            if _debug["on"]:  # the traceback asked for, and still an interruption's line and exit code
                traceback.print_exc()
            from compress.errors import MirroredError
            from compress.torchrun import env_rank

            rank = env_rank()
            # a stop the user asked for is no error: said plainly, with the exit code of an interruption
            word = "stopped" if stopped else "error"
            if not isinstance(e, MirroredError):  # rank 0 already said it
                echo(f"{word}: {e}" if rank == 0 else f"{word} [rank {rank}]: {e}", err=True)
            ctx.exit(e.exit_code)
        except BrokenPipeError:  # `compress ... | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except KeyboardInterrupt:
            if _debug["on"]:
                traceback.print_exc()
            # the pipeline's words for `compress run`; the other commands write nothing a rerun continues
            pipeline = ctx.invoked_subcommand == "run"
            echo(f"stopped: {CTRL_C_STOP if pipeline else 'interrupted (Ctrl-C)'}", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except Exception as e:
            if _debug["on"]:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            if isinstance(e, OSError) and write_problem(e):  # a write compress does not make itself (a library's)
                echo(f"error: {write_problem(e)}", err=True)
                ctx.exit(2)
            if "RANK" in os.environ and is_peer_loss(e):  # the stage is recorded interrupted: exit as one
                echo(f"stopped [rank {os.environ['RANK']}]: {peer_loss_text(first)}", err=True)
                ctx.exit(EXIT_INTERRUPTED)
            else:
                echo(f"error: unexpected {e.__class__.__name__}: {first} (rerun with --debug for the traceback)",
                     err=True)
            ctx.exit(1)


def echo(text="", **kwargs):
    """click.echo of `text` made safe for a terminal (`safe_text`): what the CLI prints carries file, folder and class
    names, and messages read from files. Standard output that cannot take it (closed, a full disk) is an error that
    says so; a reader that left (`| head`) stays the BrokenPipeError CompressGroup ends quietly on."""
    if kwargs.get("err") or kwargs.get("file") is not None:
        click.echo(safe_text(text), **kwargs)
        return
    if sys.stdout is None:  # `>&-`: click.echo would print nothing, and the command would seem to have worked
        raise CompressError("cannot write to standard output (it is closed); run the command with its output open "
                            "- to a terminal, a file, or > /dev/null to discard it")
    try:
        click.echo(safe_text(text), **kwargs)
    except BrokenPipeError:
        raise
    except OSError as e:  # not a file of the run directory's: name standard output, not a --run-dir
        raise CompressError(f"cannot write to standard output ({e.strerror or e.__class__.__name__}); send it where it "
                            "can be written - another file or disk, or > /dev/null to discard it") from None


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
