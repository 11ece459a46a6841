"""`compress run`, `stages`, `config` and `models` (compress.cli.pipeline_cmds): --stages parsed and checked,
and what the listing commands print."""

import shutil

import pytest

import stages
from conftest import invoke


@pytest.mark.e2e
def test_unknown_stage_lists_the_valid_ones():
    result = invoke("run", "--stages", "teacher,distil")
    assert result.exit_code == 2
    assert "unknown stage 'distil'" in result.output and "teacher, distill, qat, export" in result.output


@pytest.mark.e2e
def test_repeated_stages_add_up_and_a_name_beside_a_run_dir_is_refused(tmp_path):
    """Repeated --stages add up (`--stages teacher --stages distill` runs both), and --name beside --run-dir is
    refused rather than ignored without a word."""
    plan = invoke("run", "--run-dir", tmp_path / "run", "--stages", "teacher", "--stages", "distill", "--dry-run")
    assert plan.exit_code == 0, plan.output
    running = [line.split()[0] for line in plan.output.splitlines() if line.split()[1:2] == ["run"]]
    assert running == ["teacher", "distill"]
    both = invoke("run", "--run-dir", tmp_path / "run", "--name", "mine", "--dry-run")
    assert both.exit_code == 2 and "--name mine and --run-dir" in both.output and "give one" in both.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("name", ["../../escape", "/tmp/x", "", ".", "a\x1b[31mred"])
def test_a_run_name_stays_one_folder_under_artifacts(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "--name", name, "--dry-run")
    assert result.exit_code == 2 and "is not a run name: give one folder name under artifacts/" in result.output


def test_a_run_directorys_config_is_not_read_through_a_link(run_copy, tmp_path):
    """A link in place of <run>/config.yaml is refused before it is read: its target's lines would be printed
    back as unknown keys (a link to /etc/shadow printed the password hashes)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2: yes\n")
    (run_copy / "config.yaml").unlink()
    (run_copy / "config.yaml").symlink_to(secret)
    for args in (["run", "--run-dir", run_copy, "--dry-run"], ["run", "--run-dir", run_copy]):
        result = invoke(*args)
        assert result.exit_code == 2 and "hunter2" not in result.output
        assert f"run directory '{run_copy}' contains a symbolic link (config.yaml)" in result.stderr


def test_stages_are_listed_with_inputs_and_outputs():
    result = invoke("stages")
    assert result.exit_code == 0
    for name in stages.ORDER:
        assert name in result.output
    assert "teacher/model.safetensors" in result.output and "export/model.int8.onnx" in result.output
    # the default dataset is built in: no data.root to read
    assert "reads:  the dataset (its files in data.root for an image folder)" in result.output


def test_config_command_prints_resolved_yaml_and_reference():
    result = invoke("config", "--set", "teacher.epochs=11")
    assert result.exit_code == 0 and "epochs: 11" in result.output
    reference = invoke("config", "--reference").output
    assert "| `distill.kd.temperature` | float or null | `null` |" in reference
    assert "| `distill.kd.method` | hinton | dkd | dist | standardized | `standardized` |" in reference


def test_a_misspelt_stage_gets_a_suggestion_and_show_finds_the_default_run(tmp_path, finished_run, monkeypatch):
    assert "(did you mean 'distill'?)" in invoke("run", "--stages", "distil").output
    monkeypatch.chdir(tmp_path)
    (tmp_path / "artifacts").mkdir()
    shutil.copytree(finished_run, tmp_path / "artifacts" / "default")
    shown = invoke("show")
    assert shown.exit_code == 0 and "teacher  complete" in shown.stdout


def test_compress_models_names_every_form_a_model_key_takes():
    result = invoke("models")
    assert result.exit_code == 0 and "compact_cnn" in result.output and "resnet20" in result.output
    assert "torchvision:<builder>" in result.output and "<module>:<function>" in result.output  # not the README alone


def test_a_directory_left_with_only_decoded_images_is_not_run_on_the_defaults(tmp_path):
    """A first run stopped while decoding leaves cache/pixels/ and no config.yaml: a plain `compress run` there
    would train the built-in digits; it is refused, saying to rerun that run's command (which still works)."""
    run = tmp_path / "photos-run"
    (run / "cache" / "pixels" / "train-0123456789abcdef").mkdir(parents=True)
    for args in ([], ["--dry-run"]):
        result = invoke("run", "--run-dir", run, *args)
        assert result.exit_code == 2, result.output
        assert (f"'{run}' holds only the images a first run decoded before it stopped, not its config: rerun that "
                "run's command, with its -c and --set") in result.stderr
    assert sorted(p.name for p in run.iterdir()) == ["cache"]
    given = invoke("run", "--run-dir", run, "--dry-run", "--set", "teacher.epochs=1")  # a command that says what
    assert given.exit_code == 0, given.output


def test_config_refuses_two_things_to_print_and_stages_a_folder_that_is_no_run(tmp_path):
    both = invoke("config", "--reference", "--list")
    assert both.exit_code == 2 and "--reference and --list each print something else; give one" in both.output
    (tmp_path / "notes").mkdir()
    result = invoke("stages", "--run-dir", tmp_path / "notes")
    assert result.exit_code == 2 and "is not a compress run directory (no manifest.json)" in result.output
