"""The `compress` command line. Commands are thin: they parse, then call one library function.

`COMMANDS` maps every command name to its function (a test checks it matches the CLI)."""

from compress.cli.base import cli, setup_logging
from compress.cli.deploy_cmds import bench, eval_cmd, predict
from compress.cli.inspect_cmds import report, show
from compress.cli.pipeline_cmds import config_cmd, models_cmd, run, stages_cmd

__all__ = ["COMMANDS", "cli", "main", "setup_logging"]

COMMANDS = {"run": run, "stages": stages_cmd, "config": config_cmd, "models": models_cmd, "predict": predict,
            "eval": eval_cmd, "bench": bench, "show": show, "report": report}


def main(argv=None):
    cli.main(args=argv, prog_name="compress")


if __name__ == "__main__":
    main()
