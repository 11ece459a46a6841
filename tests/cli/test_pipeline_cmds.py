import dataclasses

import pytest

import stages
from compress import __version__, cli
from compress.run.config import Config
from compress.run.contract import Code, Images
from conftest import compress_subprocess, invoke


def test_registries_agree_cli_config_and_folders():
    """One stage registry (the CLI's --stages default comes from it); each stage's keys exist in the config."""
    from compress.run.config import config_slice

    run_option = next(p for p in cli.cli.commands["run"].params if p.name == "stages")
    assert tuple(stages.STAGES) == stages.ORDER and f"[default: {','.join(stages.ORDER)}]" in run_option.help
    config_sections = {f.name for f in dataclasses.fields(Config)}
    for name, module in stages.STAGES.items():
        assert module.NAME == name
        assert name in config_sections, f"stage {name} has no config section"
        assert all(out.startswith(f"{name}/") for out in module.OUTPUTS.values()), "a stage writes only its own folder"
        assert callable(module.run) and callable(module.inputs) and callable(module.report_rows)
        assert config_slice(Config(), module.CONFIG_KEYS)  # every declared key names a part of the config
        for item in module.inputs(Config()):  # every input names another stage's declared output, or images
            if isinstance(item, Images):
                assert item.key in ("root", "unlabeled")
                continue
            if isinstance(item, Code):
                assert item.key in ("model.teacher", "model.student")
                continue
            assert item.stage in stages.STAGES and item.output in stages.STAGES[item.stage].OUTPUTS


def test_command_dict_matches_the_cli():
    assert set(cli.COMMANDS) == set(cli.cli.commands)
    for name, command in cli.COMMANDS.items():
        assert cli.cli.commands[name] is command


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_help_teaches_with_an_example(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output


def test_version_in_process_and_installed_script():
    assert __version__ in invoke("--version").output
    proc = compress_subprocess("--version")
    assert proc.returncode == 0 and __version__ in proc.stdout


def test_unknown_stage_lists_the_valid_ones():
    result = invoke("run", "--stages", "teacher,distil")
    assert result.exit_code == 2
    assert "unknown stage 'distil'" in result.output and "teacher, distill, qat, export" in result.output


def test_repeated_stages_add_up_and_a_name_beside_a_run_dir_is_refused(tmp_path):
    """Was (fresh-user pass): `--stages teacher --stages distill` ran distill alone, and --name beside --run-dir was
    ignored without a word."""
    plan = invoke("run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--stages", "distill", "--dry-run")
    assert plan.exit_code == 0, plan.output
    running = [line.split()[0] for line in plan.output.splitlines() if line.split()[1:2] == ["run"]]
    assert running == ["teacher", "distill"]
    both = invoke("run", "--run-dir", tmp_path / "run", "--name", "mine", "--dry-run")
    assert both.exit_code == 2 and "--name mine and --run-dir" in both.output and "give one" in both.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "artifacts").exists()


def test_stages_are_listed_with_inputs_and_outputs():
    result = invoke("stages")
    assert result.exit_code == 0
    for name in stages.ORDER:
        assert name in result.output
    assert "teacher/model.safetensors" in result.output and "export/model.int8.onnx" in result.output


def test_config_command_prints_resolved_yaml_and_reference():
    result = invoke("config", "--set", "teacher.epochs=11")
    assert result.exit_code == 0 and "epochs: 11" in result.output
    reference = invoke("config", "--reference").output
    assert "| `distill.kd.temperature` | float or null | `null` |" in reference
    assert "| `distill.kd.method` | hinton | dkd | dist | standardized | `standardized` |" in reference
