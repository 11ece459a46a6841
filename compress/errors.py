"""Errors meant for users: one sentence, an exit code, no traceback (unless --debug)."""

from compress.torchrun import restarts_left

EXIT_FAILED = 1  # a stage ran and failed its own check (accuracy budget, NaN loss, parity)
EXIT_BAD_INPUT = 2  # bad config, CLI argument, path, checkpoint, image
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM; the resume checkpoint was written
# a Ctrl-C outside a training step (listing, decoding, between stages): the terminal's last line and the run log's
CTRL_C_STOP = ("interrupted (Ctrl-C); rerun the same command to go on - finished stages are kept, an interrupted one "
               "resumes from its last checkpoint")


class CompressError(Exception):
    """Base class: the message is shown to the user as is."""

    exit_code = EXIT_BAD_INPUT


LONGEST_PROBLEM = 1000  # characters of one problem said; a 5-million-character value is not echoed whole


def _shortened(problem):
    """`problem` with the middle of an overlong one left out: its start names the key, its end what to do."""
    problem = str(problem)
    if len(problem) <= LONGEST_PROBLEM:
        return problem
    cut = len(problem) - LONGEST_PROBLEM + 200
    return f"{problem[:LONGEST_PROBLEM - 400]} ... ({cut:,} characters left out) ... {problem[-200:]}"


class ConfigError(CompressError):
    """Config file or override problems; carries every problem found, not just the first."""

    def __init__(self, problems, source=None):
        self.problems = [_shortened(p) for p in problems]
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.problems) == 1:
            msg = f"config error{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            msg = f"{len(self.problems)} config errors{where}:\n{lines}"
        super().__init__(msg)


class InputError(CompressError):
    """A missing or unreadable input: dataset path, checkpoint, ONNX file, image."""


class CheckpointError(InputError):
    """A checkpoint that is missing, truncated, edited, or belongs to another model."""


class StageFailed(CompressError):
    """A stage ran to the end but failed a check it is responsible for."""

    exit_code = EXIT_FAILED


class Interrupted(CompressError):
    """Stopped by a signal after writing the resume checkpoint."""

    exit_code = EXIT_INTERRUPTED


class MirroredError(CompressError):
    """Another rank's (or rank 0's) error, raised on this rank too so no rank waits at a collective; only the
    rank that found it prints it."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


def is_peer_loss(e):
    """Whether an error is a worker's lost contact with another (a peer killed, its node gone): torch.distributed's
    own errors, and the gloo/NCCL transport's words. Nothing about the run is wrong; the stage was cut off."""
    return type(e).__module__.startswith("torch.distributed") or any(
        marker in str(e) for marker in ("gloo", "NCCL", "Connection reset", "Connection closed by peer"))


def peer_loss_words(text):
    """The transport's own words for a lost peer, without its source location and cut at a word: '[.../pair.cc:545]
    Read error [127.0.0.1]:17536: Connection reset by peer. This is typically ...' -> 'Read error [127.0.0.1]:17536:
    Connection reset by peer'."""
    import re

    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text.strip())
    sentence = text.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= 120 else sentence[:120].rsplit(" ", 1)[0] + " ..."


def peer_loss_text(first_line, environ=None):
    """What a worker that lost its peers says, after 'stopped', on the terminal and as its run log's last line:
    that the launcher restarts the group where it has restarts left (`compress run --max-restarts`, or torchrun's),
    else the command that resumes."""
    lost = ("lost contact with another process of the run (it stopped, crashed or was killed; "
            f"{peer_loss_words(first_line)})")
    left, asked = restarts_left(environ)
    if left:
        return (f"{lost}; the launcher restarts the group ({left} restart(s) left), which resumes from the last "
                "checkpoint")
    return (f"{lost}; rerun the same command to resume from the last checkpoint"
            + ("" if asked else " - with --max-restarts N the group restarts and resumes by itself"))
