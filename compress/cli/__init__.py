"""The `compress` command line. Commands are thin: they parse, then call one library function.

`COMMANDS` maps every command name to its function (a test checks it matches the CLI)."""

import os

# onnxruntime (1.32 on Linux) keeps a device id and an event database in ~/.cache/Microsoft/DeveloperTools and
# sends usage events where the network allows; compress writes nothing outside the run directory, so it opts out
# for its own processes (their workers included) unless the variable is set already
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from compress.cli.base import cli, setup_logging  # noqa: E402
from compress.cli.deploy_cmds import bench, eval_cmd, predict  # noqa: E402
from compress.cli.inspect_cmds import report, show  # noqa: E402
from compress.cli.pipeline_cmds import config_cmd, models_cmd, run, stages_cmd  # noqa: E402

__all__ = ["COMMANDS", "cli", "main", "setup_logging"]

COMMANDS = {"run": run, "stages": stages_cmd, "config": config_cmd, "models": models_cmd, "predict": predict,
            "eval": eval_cmd, "bench": bench, "show": show, "report": report}


def main(argv=None):
    cli.main(args=argv, prog_name="compress")


if __name__ == "__main__":
    main()
