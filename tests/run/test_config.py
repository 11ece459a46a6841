"""The config (compress.run.config, compress.run.schema): parsed once into validated dataclasses, every problem
reported at once with its key path, YAML read safely (keys given twice, alias bombs), and each stage's view."""

import glob
import os
import subprocess
import sys

import pytest
import yaml

from compress.errors import ConfigError, InputError
from compress.run import preflight, schema
from compress.run.config import Config, dump_config, load_config, section_hash
from conftest import HANG, ROOT, compress_subprocess, file_bytes, invoke


def test_default_yaml_is_the_builtin_default_and_lists_every_key():
    """configs/default.yaml is the file users copy to start their own: every key, at its built-in value."""
    path = os.path.join(ROOT, "configs", "default.yaml")
    assert load_config(path) == Config()
    written = yaml.safe_load(open(path))
    missing = object()
    assert [key for key, *_ in schema.reference(Config) if schema.get_path(written, key, missing) is missing] == []


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_shipped_config_validates(path, tmp_path):
    root = (yaml.safe_load(open(path)).get("data") or {}).get("root")  # a recipe for a folder: point it at one
    cfg = load_config(path, [f"data.root={tmp_path}"] if root else [])
    assert isinstance(cfg, Config)


def test_all_problems_reported_at_once_with_key_paths(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  nmae: digits\nteacher:\n  epochs: three\n  lr: -1\nqat:\n  backend: arm\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(bad))
    problems = info.value.problems
    assert "unknown key 'data.nmae' (did you mean 'data.name'?)" in problems
    assert "teacher.epochs: expected a whole number, got str 'three'" in problems
    assert any(p.startswith("qat.backend: must be one of x86, qnnpack") for p in problems)
    assert str(bad) in str(info.value)


def test_a_refused_value_is_traced_to_the_file_or_to_the_set_that_gave_it(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("teacher:\n  epochs: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(config), ["distill.kd.temperature=-1", "distill.kd.temprature=1"])
    assert str(info.value) == ("2 config errors in --set:\n  - unknown key 'distill.kd.temprature' (did you mean "
                               "'distill.kd.temperature'?)\n  - distill.kd.temperature: must be between 0.05 and "
                               "1000, or null, got -1.0 (a smaller one makes the softened outputs one-hot and the "
                               "loss overflow)")
    assert str(config) not in str(info.value)  # the file is fine: nothing to look for there
    config.write_text("teacher:\n  epochs: -3\ndistill:\n  epochs: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(config), ["distill={epochs: x}"])
    assert str(info.value) == (f"2 config errors in {config}:\n  - teacher.epochs: must be between 0 and 100000, "
                               "got -3\n  - distill.epochs: expected a whole number, got str 'x' (from --set)")
    with pytest.raises(ConfigError) as info:  # an item of a list --set gave
        load_config(str(config), ["teacher.epochs=2", "data.mean=[a]"])
    assert str(info.value) == "config error in --set: data.mean[0]: expected a number, got str 'a'"
    config.write_text("distill:\n  kd:\n    weightx: 2\n")  # a key that --set's key begins, but not --set's
    with pytest.raises(ConfigError) as info:
        load_config(str(config), ["distill.kd.weight=1"])
    assert str(info.value) == (f"config error in {config}: unknown key 'distill.kd.weightx' (did you mean "
                               "'distill.kd.weight'?)")
    # a --set below a key the config does not have, or below a value, and a problem of two keys one of them set
    for sets, problem in ((["foo.bar.baz=1"], "unknown key 'foo'"), (["data.name.x=1"], "data.name: expected a "
                          "string, got a mapping"), (["data.mean=[]"], "data.mean/std: give both or neither"),
                          (["data.a/b=1"], "unknown key 'data.a/b'")):
        with pytest.raises(ConfigError) as info:
            load_config(None, sets)
        assert str(info.value).startswith(("config error in --set: ", "2 config errors in --set:")), sets
        assert problem in str(info.value) and "(from --set)" not in str(info.value)


def test_range_checks_of_a_section_are_all_reported():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["teacher.lr=-1", "teacher.batch_size=0", "export.opset=9"])
    assert len(info.value.problems) == 3
    assert {p.split(":")[0] for p in info.value.problems} == {"teacher.lr", "teacher.batch_size", "export.opset"}


def test_qat_needs_a_loss():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["qat.ce_weight=0", "qat.kd_weight=0", "qat.kd_temperature=0"])
    assert {p.split(":")[0] for p in info.value.problems} == {"qat.ce_weight, kd_weight", "qat.kd_temperature"}
    assert load_config(None, ["qat.ce_weight=0"]).qat.kd_weight == 1.0  # distillation from the float model alone


def test_each_logit_loss_gets_its_papers_weights_unless_the_config_sets_them():
    """The weights go with the method (Sun et al.'s CE 0.1 / KD 9 would swamp Hinton KD at T 4): switching only
    kd.method gives that method's paper setting; a weight the config sets is kept whatever the method."""
    d = load_config(None).distill
    assert (d.kd.method, d.resolved_ce_weight, d.kd.resolved_weight, d.kd.resolved_temperature) == (
        "standardized", 0.1, 9.0, 2.0)
    # DIST: KD 2, as its official code's CIFAR configs
    expected = {"hinton": (0.1, 0.9, 4.0), "dkd": (1.0, 1.0, 4.0), "dist": (1.0, 2.0, 4.0)}
    for method, weights in expected.items():
        d = load_config(None, [f"distill.kd.method={method}"]).distill
        assert (d.resolved_ce_weight, d.kd.resolved_weight, d.kd.resolved_temperature) == weights, method
    d = load_config(None, ["distill.kd.method=hinton", "distill.ce_weight=0.5", "distill.kd.weight=0"]).distill
    assert (d.resolved_ce_weight, d.kd.resolved_weight) == (0.5, 0.0)
    assert load_config(None, ["distill.ce_weight=0"]).distill.kd.resolved_weight == 9.0  # KD alone is a loss
    from compress.distill.objective import describe_loss  # what the log says the stage trains on
    assert describe_loss(load_config(None).distill).startswith("0.1 x cross-entropy + 9 x standardized-logit KD (T 2)")
    assert describe_loss(load_config(None, ["distill.kd.method=hinton", "distill.ce_weight=0.5"]).distill) == (
        "0.5 x cross-entropy + 0.9 x Hinton KD (T 4); kd.weight, kd.temperature: the Hinton KD paper's values; set by "
        "the config, not the Hinton KD paper's: ce_weight 0.5 (paper 0.1) (null takes the paper's; a recipe's values "
        "stay when only distill.kd.method changes)")
    # hinton under the cifar10 recipe keeps the recipe's KD 9 and T 1, and says they are not the paper's
    assert describe_loss(load_config("configs/cifar10.yaml", ["distill.kd.method=hinton"]).distill).endswith(
        "set by the config, not the Hinton KD paper's: kd.weight 9 (paper 0.9), kd.temperature 1 (paper 4) (null "
        "takes the paper's; a recipe's values stay when only distill.kd.method changes)")
    with pytest.raises(ConfigError, match="at least one must be > 0"):
        load_config(None, ["distill.ce_weight=0", "distill.kd.weight=0"])
    from compress.distill.objective import loss_problems as _loss_problems  # settings that quietly change it
    assert _loss_problems(load_config("configs/cifar10.yaml").distill) == []
    alone = _loss_problems(load_config(None, ["distill.kd.weight=0"]).distill)
    assert alone and "no loss here learns from the teacher" in alone[0]
    dkd = _loss_problems(load_config(None, ["distill.kd.method=dkd", "distill.epochs=5"]).distill)
    assert dkd and "it reaches only 25% of its weight" in dkd[0]


def test_overrides_are_parsed_as_yaml_values():
    cfg = load_config(None, ["teacher.epochs=7", "distill.kd.temperature=4", "data.mean=[0.5]", "data.std=[0.25]",
                             "qat.per_channel=false", "teacher.lr=3e-4"])
    assert cfg.teacher.epochs == 7 and cfg.distill.kd.temperature == 4.0
    assert cfg.data.mean == (0.5,) and cfg.qat.per_channel is False and cfg.teacher.lr == 3e-4


def test_an_empty_value_for_a_section_is_refused_not_read_as_its_defaults():
    """`--set data=` would otherwise drop every data key the config file gave (data.root among them) without a
    word; a key set to empty is null as before, and an explicit {} still resets a section."""
    with pytest.raises(ConfigError, match=r"config error in --set: 'data' is a section, and an empty value would "
                                          r"reset every key in it .*--set data.name=\.\.\."):
        load_config(overrides=["data="])
    with pytest.raises(ConfigError, match=r"'distill.kd' is a section"):
        load_config(overrides=["distill.kd=null"])
    assert load_config(overrides=["model.teacher_weights="]).model.teacher_weights is None
    assert load_config(overrides=["data.root=/x", "data={}"]).data.root is None


def test_a_number_yaml_would_read_in_base_60_is_refused(tmp_path):
    """YAML 1.1 reads a plain 12:30 as 750 (and 1:00.5 as 60.5): refused in --set and in a file, naming the key;
    quoted, it is text, which a number's key then refuses as text."""
    with pytest.raises(ConfigError, match=r"config error in --set seed: '12:30' reads as a base-60 number in YAML "
                                          r"\(750\); write the number itself, or quote it if text is meant"):
        load_config(None, ["seed=12:30"])
    config = tmp_path / "c.yaml"
    config.write_text("teacher:\n  lr: 1:00.5\n")
    with pytest.raises(ConfigError, match=r"teacher.lr: '1:00.5' reads as a base-60 number in YAML \(60.5\)"):
        load_config(str(config), [])
    with pytest.raises(ConfigError, match=r"seed: expected a whole number, got str '12:30'"):
        load_config(None, ["seed='12:30'"])
    text = load_config(None, ["data.name=imagefolder", "data.root=/photos/12:30"])  # text stays text
    assert text.data.root == "/photos/12:30"


def test_a_number_yaml_would_read_in_another_base_is_refused(tmp_path):
    """YAML 1.1 reads a plain 010 as 8 and 0b11 as 3: refused in --set and in a file, naming the key; hex (0x10)
    and a plain 0 are what they look like."""
    with pytest.raises(ConfigError, match=r"config error in --set seed: '010' reads as a number in another base in "
                                          r"YAML \(8\); write it without the leading 0"):
        load_config(None, ["seed=010"])
    config = tmp_path / "c.yaml"
    config.write_text("teacher:\n  epochs: 0b11\n")
    with pytest.raises(ConfigError, match=r"teacher.epochs: '0b11' reads as a number in another base in YAML \(3\)"):
        load_config(str(config), [])
    assert load_config(None, ["seed=0x10"]).seed == 16 and load_config(None, ["seed=0"]).seed == 0


def test_a_set_string_keeps_what_yaml_would_cut():
    """--set data.root=/photos #2 is a folder named '/photos #2', not '/photos' and a comment; an anchor or a tag
    is text too, and so is a path with ': ' in it (YAML would read a mapping) where the key takes only text.
    Quoted, YAML's quotes still apply."""
    for text in ("/photos #2", "&a /photos", "!!str /photos", "/photos/trip: day 1"):
        assert load_config(None, ["data.name=imagefolder", f"data.root={text}"]).data.root == os.path.abspath(text)
    assert load_config(None, ["data.name=imagefolder", "data.root='/my photos'"]).data.root == "/my photos"
    assert load_config(None, ["teacher.lr=1e-3 # lower"]).teacher.lr == 1e-3  # a number stays one (YAML: text)


def test_a_text_file_that_is_no_config_is_not_echoed_back_key_by_key(tmp_path):
    """`-c` on another file (a password file, notes) parses as YAML keys: it is named as no config in one
    sentence, its lines not printed back as unknown keys; a config with a misspelt section still gets the hint."""
    other = tmp_path / "shadow"
    other.write_text("".join(f"user{i}:$6$secret{i}:20228:0:99999:7:::\n" for i in range(5)))
    with pytest.raises(ConfigError) as info:
        load_config(str(other), [])
    assert str(info.value) == (f"config error in {other}: none of its 5 top-level keys is a config section (seed, "
                               "data, model, train, teacher, distill, qat, export); is it really a compress config?")
    dotted = tmp_path / "dotted.yaml"  # --set's keys written as a file: not called "no config"
    dotted.write_text("data.root: x\nteacher.epochs: 3\ndistill.epochs: 3\nqat.epochs: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(dotted), [])
    assert "is it really" not in str(info.value) and "unknown key 'data.root'" in str(info.value)
    misspelt = tmp_path / "c.yaml"
    misspelt.write_text("teachr: {epochs: 3}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'teachr' \(did you mean 'teacher'\?\)"):
        load_config(str(misspelt), [])


def test_an_oversized_config_file_is_called_that(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) * 17 + "\n")
    with pytest.raises(InputError, match=r"config file '.*big.yaml' is over [\d,]+ bytes, far more than a config; "
                                         r"is it really one\?"):
        load_config(str(big), [])


def test_override_without_equals_sign_is_a_config_error():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(None, ["teacher.epochs"])


def test_yaml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("teacher:\n  epochs: 3\n lr: [\n")
    with pytest.raises(ConfigError, match="YAML syntax error at line"):
        load_config(str(bad))


def test_missing_config_file_and_missing_dataset_folder(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))
    # parsing never touches the disk: the folder is checked by the preflight step, before anything is written
    cfg = load_config(None, ["data.name=imagefolder", f"data.root={tmp_path / 'missing'}", "model.student=tiny"])
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, ["teacher"], world_size=3)
    problems = info.value.problems
    assert any(p.startswith("data.root: folder") and "does not exist" in p for p in problems)
    assert any(p.startswith("model.student: unknown model 'tiny'") for p in problems)
    assert "teacher.batch_size: 64 does not split evenly over 3 processes; use a multiple of 3" in problems
    with pytest.raises(ConfigError) as info:  # no batch splits over more processes than it may hold images
        preflight.check(cfg, ["teacher"], world_size=100000)
    assert ("teacher.batch_size: 64 does not split evenly over 100,000 processes; a batch holds at most 65,536 "
            "images, so run at most 65,536 processes") in info.value.problems
    (tmp_path / "photos.zip").write_bytes(b"PK\x03\x04")  # a file is named as a file, not as missing
    cfg = load_config(None, ["data.name=imagefolder", f"data.root={tmp_path / 'photos.zip'}"])
    assert f"data.root: '{tmp_path / 'photos.zip'}' is a file, not a folder; unpack it and point data.root at the " \
        "folder that holds the images" in preflight.problems(cfg, ["teacher"], 1)


def test_a_config_that_is_no_regular_file_is_refused_without_being_read(tmp_path):
    """A device (/dev/zero would be read forever) or a FIFO (its open would wait for a writer) as -c."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):  # in a process of its own: a regression fails here instead of hanging
        proc = compress_subprocess("config", "-c", path, timeout=HANG)
        assert proc.returncode == 2 and proc.stderr == (
            f"error: config file '{path}' is not a regular file (a pipe, device or socket); replace it with the file "
            "itself\n")


def test_parsing_a_config_is_pure():
    """No torch import and no filesystem access while parsing: `compress config` and `--help` stay instant."""
    code = ("import sys; from compress.run.config import load_config; "
            "load_config(None, ['data.name=imagefolder', 'data.root=/nonexistent', 'model.teacher=torchvision:x']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("override,message", [
    ("qat.max_accuracy_drop=nan", "qat.max_accuracy_drop: expected a finite number"),
    ("data.std=[.inf]", "data.std[0]: expected a finite number"),
    ("teacher.lr=inf", "teacher.lr: expected a finite number"),
    ("data.image_size=100000", "data.image_size: must be between 8 and 2048"),
    ("seed=100000000000000000000000", "seed: 100000000000000000000000 is far too large"),
    ("seed=-1", "seed: must be between 0 and"),
    ("distill.kd.temperature=.NaN", "distill.kd.temperature: expected a finite number"),
])
def test_non_finite_and_absurd_numbers_are_refused(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert any(p.startswith(message) for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("override,message", [
    ("distill.ce_weight=abc", "distill.ce_weight: expected a number or null, got str 'abc'"),
    ("distill.views=x", "distill.views: expected a whole number or null, got str 'x'"),
    ("distill.kd.weight=nan", "distill.kd.weight: expected a finite number or null, got 'nan'"),
])
def test_a_key_that_may_be_null_says_so_when_its_value_is_refused(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.problems == [message]


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["distill.hint.weight=0.5", "data.name=digits"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)) == cfg


def test_section_hash_follows_only_its_sections():
    base = Config()
    changed_teacher = load_config(None, ["teacher.epochs=9"])
    changed_runtime = load_config(None, ["train.eval_batch_size=7"])
    keys = ("seed", "data", "model.teacher", "teacher")
    assert section_hash(base, keys) != section_hash(changed_teacher, keys)
    assert section_hash(base, keys) == section_hash(changed_runtime, keys)
    assert section_hash(base, ("distill",)) == section_hash(changed_teacher, ("distill",))


def test_reference_lists_every_leaf_key():
    keys = [row[0] for row in schema.reference(Config)]
    assert "distill.kd.temperature" in keys and "export.latency_batch_sizes" in keys and "seed" in keys
    assert all(row[3] for row in schema.reference(Config)), "every key needs a help text"


def test_a_stage_sees_only_its_config_keys_and_train():
    from compress.run.config import ConfigView, UndeclaredConfigRead
    from stages import teacher

    view = ConfigView(load_config(None, ["teacher.epochs=7"]), teacher.CONFIG_KEYS)
    assert view.teacher.epochs == 7 and view.model.teacher == "resnet14" and view.train.device == "auto"
    assert view.data.name == "mnist5k"
    for read in (lambda: view.distill, lambda: view.model.student, lambda: view.data.unlabeled):
        with pytest.raises(UndeclaredConfigRead, match="is not among this stage's CONFIG_KEYS"):
            read()


@pytest.mark.e2e
def test_the_pipeline_hands_each_stage_the_view_so_an_undeclared_read_fails(tiny_config, tmp_path, monkeypatch):
    """A stage that reads a key it did not declare would not rerun when that key changes: the run fails at the
    read, naming the key (here the teacher stage with 'teacher' taken out of its keys)."""
    from stages import teacher

    monkeypatch.setattr(teacher, "CONFIG_KEYS", tuple(k for k in teacher.CONFIG_KEYS if k != "teacher"))
    result = invoke("run", "-c", tiny_config, "--run-dir", tmp_path / "run", "--stages", "teacher")
    assert result.exit_code == 1
    assert "UndeclaredConfigRead: 'teacher' is not among this stage's CONFIG_KEYS" in result.stderr


def test_every_stage_key_and_exclusion_names_a_real_part_of_the_config():
    from compress.run.config import Config, config_slice
    from stages import STAGES

    for name, spec in STAGES.items():
        picked = config_slice(Config(), spec.CONFIG_KEYS)
        if "-data.unlabeled" in spec.CONFIG_KEYS:
            assert "unlabeled" not in picked["data"], name


def test_a_store_never_holds_views_no_epoch_shows():
    """A store holds no more views than epochs show (distill.views 4 with distill.epochs 1 builds one, not 4 at 68 s
    for a resnet18 teacher). View e is the same pixels whatever the count, so capping changes no result."""
    d = load_config(None, ["distill.views=4", "distill.epochs=1"]).distill
    assert (d.views_for(True), d.views_for(False)) == (1, 1)
    assert load_config(None, ["distill.views=4", "distill.epochs=10"]).distill.views_for(True) == 4
    assert load_config(None, ["distill.epochs=7"]).distill.views_for(True) == 7  # null: one per epoch


def numeric_keys():
    """Every int or float key of the config, by its dotted path."""
    from compress.run.config import Config
    from compress.run.schema import reference

    return [key for key, tp, _, _ in reference(Config) if tp.split()[0] in ("int", "float")]


def test_every_refused_number_is_told_both_ends_of_its_range():
    """A value far above any limit and one far below: a refusal names the range with both ends ('between A and
    B', '(A, B]', '[A, B)') - never a one-sided 'must be >= A' whose other end is a secret."""
    import re

    number = r"-?[\d,.e+-]+"
    two_ends = re.compile(rf"between {number} and {number}|[(\[]{number}, {number}[)\]]|must be \d or \d")
    told = 0
    for key in numeric_keys():
        for value in (10**14, -(10**14)):
            try:
                load_config(None, [f"{key}={value}"])
            except ConfigError as e:
                mine = [p for p in e.problems if p.startswith(f"{key}:")]
                if mine and "far too large" not in mine[0]:
                    told += 1
                    assert two_ends.search(mine[0]), mine[0]
                    assert "must be >=" not in mine[0] and "at least" not in mine[0], mine[0]
    assert told > 30  # the checks are there to be read


def test_a_degenerate_normalisation_std_is_refused_with_its_range():
    """A std of almost nothing blows the pixels up and trains to NaN ('lower teacher.lr' was the advice)."""
    with pytest.raises(ConfigError, match=r"data.std: every value must be between 0.001 and 1000 \(pixels are scaled "
                                          r"to 0..1"):
        load_config(None, ["data.mean=[0.5]", "data.std=[1e-30]"])
    assert load_config(None, ["data.mean=[0.5]", "data.std=[0.25]"]).data.std == (0.25,)
    with pytest.raises(ConfigError, match=r"train.clip_grad_norm: must be in \(0, 1,000,000\]"):
        load_config(None, ["train.clip_grad_norm=0"])


def test_norm_weight_decay_decays_the_1d_parameters_apart_and_its_null_keeps_finished_stages_current():
    import torch

    from compress.run.config import as_it_counts
    from compress.training.schedule import build_optimizer

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(4, 2))
    apart = load_config(None, ["teacher.optimizer=adamw", "teacher.weight_decay=0.05", "teacher.norm_weight_decay=0"])
    groups = build_optimizer(model.parameters(), apart.teacher).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(2, 0.05), (4, 0.0)]  # 2 weights, 4 1-D
    same = build_optimizer(model.parameters(), load_config(None, []).teacher).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in same] == [(6, 0.0005)]
    # a run recorded before the key existed has no such key in its slice: null must hash as that did
    assert as_it_counts({"teacher": {"lr": 0.1, "norm_weight_decay": None}}, False) == {"teacher": {"lr": 0.1}}
    assert as_it_counts({"teacher": {"lr": 0.1, "norm_weight_decay": 0.0}}, False) == \
        {"teacher": {"lr": 0.1, "norm_weight_decay": 0.0}}


def test_export_latency_threads_is_checked_and_its_null_keeps_finished_qat_and_export_current():
    from compress.run.config import as_it_counts, config_slice, result_hash
    from stages import STAGES

    with pytest.raises(ConfigError, match=r"export.latency_threads: give thread counts between 1 and 1024"):
        load_config(None, ["export.latency_threads=[0, 2]"])
    with pytest.raises(ConfigError, match=r"export.latency_threads: give thread counts between 1 and 1024"):
        load_config(None, ["export.latency_threads=[]"])
    with pytest.raises(ConfigError, match=r"export.latency_threads: give each thread count once, got \[2, 1, 2\]"):
        load_config(None, ["export.latency_threads=[2, 1, 2]"])
    assert load_config(None, ["export.latency_threads=[1, 2]"]).export.latency_threads == (1, 2)
    cfg = load_config(None, [])
    # a run recorded before the key existed has none in its slice: null must count as that did, both where a
    # stage reads the key on its own (qat: 'export.latency_threads') and inside a section (export)
    qat = config_slice(cfg, STAGES["qat"].CONFIG_KEYS)
    older = {k: v for k, v in qat.items() if k != "export.latency_threads"}
    assert "export.latency_threads" in qat and as_it_counts(qat, False) == as_it_counts(older, False)
    export = config_slice(cfg, STAGES["export"].CONFIG_KEYS)
    older = {**export, "export": {k: v for k, v in export["export"].items() if k != "latency_threads"}}
    assert "latency_threads" in export["export"] and as_it_counts(export, False) == as_it_counts(older, False)
    chosen = load_config(None, ["export.latency_threads=[1, 2]"])
    for stage in ("qat", "export"):  # a value reruns both: the verdict and the float-layer choice weigh it
        keys = STAGES[stage].CONFIG_KEYS
        assert result_hash(chosen, keys, False) != result_hash(cfg, keys, False)


@pytest.mark.e2e
def test_a_config_with_a_key_twice_is_refused_with_both_lines(tmp_path):
    config = tmp_path / "twice.yaml"
    config.write_text("teacher:\n  epochs: 3\n  lr: 0.1\n  epochs: 30\n")
    result = invoke("run", "-c", config, "--run-dir", tmp_path / "run")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: config error in {config}: key 'teacher.epochs' appears twice (lines 2 "
                                     "and 4); keep one")
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_a_folder_given_with_a_built_in_dataset_is_refused_not_ignored(tmp_path):
    """data.root with a built-in dataset is refused, naming data.name=imagefolder, rather than ignored while the
    run trains on the shipped digits."""
    result = invoke("run", "--run-dir", tmp_path / "run", "--set", f"data.root={tmp_path}")
    assert result.exit_code == 2 and not (tmp_path / "run").exists()
    assert "data.root: '" in result.stderr
    assert "set data.name: imagefolder (--set data.name=imagefolder)" in result.stderr


def alias_bomb(levels=9):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\nseed: 0\n"


def test_a_yaml_alias_bomb_is_refused_before_any_walk(tmp_path, run_copy):
    """A YAML alias bomb (9 levels of 9 aliases: 387 million values) is refused before any walk of the expanded
    tree."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    proc = compress_subprocess("config", "-c", bomb, timeout=HANG)
    assert proc.returncode == 2 and f"config error in {bomb}: its YAML aliases (*name) expand to more than 100,000 " \
        "values" in proc.stderr, proc.stderr
    before = file_bytes(run_copy)
    (run_copy / "config.yaml").write_text(alias_bomb())
    proc = compress_subprocess("run", "--run-dir", run_copy, "--stages", "export", timeout=HANG)
    assert proc.returncode == 2 and f"config error in {run_copy / 'config.yaml'}: its YAML aliases" in proc.stderr
    proc = compress_subprocess("config", "--set", "data.mean=&a [*a]", timeout=HANG)  # a value containing itself
    assert proc.returncode == 2 and "refers to a value that contains it" in proc.stderr, proc.stderr
    assert {k: v for k, v in file_bytes(run_copy).items() if k != "config.yaml"} == {
        k: v for k, v in before.items() if k != "config.yaml"}


@pytest.mark.parametrize("levels", [40, 3000])
def test_deeply_nested_yaml_is_one_sentence_not_a_recursion_error(tmp_path, levels):
    """Thousands of nested brackets exhausted Python's stack in PyYAML ("unexpected RecursionError", naming no file);
    any nesting beyond what a config has is refused naming the file or the --set key."""
    nested = "[" * levels + "]" * levels
    path = tmp_path / "deep.yaml"
    path.write_text(f"data:\n  mean: {nested}\n")
    result = invoke("config", "-c", path)
    assert result.exit_code == 2 and f"config error in {path}: its values nest more than 32 levels deep" in \
        result.stderr, result.stderr
    result = invoke("config", "--set", f"data.mean={nested}")
    assert result.exit_code == 2 and "config error in --set data.mean: its values nest more than 32 levels deep" in \
        result.stderr, result.stderr


def test_yaml_anchors_of_a_normal_config_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("teacher: {lr: &lr 0.2, epochs: 1}\ndistill: {lr: *lr}\n")
    result = invoke("config", "-c", path)
    assert result.exit_code == 0 and result.output.count("lr: 0.2") == 2


def test_relative_paths_typed_now_are_saved_absolute_and_a_weights_file_spelled_another_way_is_the_same(
        tmp_path, monkeypatch):
    """A run's config.yaml is read from wherever a later command runs: `data.root=imgs` typed in /work is saved as
    /work/imgs ('~/photos' and weights names stay as typed), while a run's own config.yaml is read as saved. Two
    spellings of one weights file give one result hash (its sha256 is the stage's input)."""
    from compress.run.config import result_hash

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.name=imagefolder", "data.root=imgs", "data.unlabeled=~/more",
                             "model.teacher_weights=w.safetensors", "model.student_weights=pretrained"])
    assert (cfg.data.root, cfg.data.unlabeled) == (str(tmp_path / "imgs"), "~/more")
    assert (cfg.model.teacher_weights, cfg.model.student_weights) == (str(tmp_path / "w.safetensors"), "pretrained")
    saved = tmp_path / "config.yaml"
    saved.write_text("data:\n  name: imagefolder\n  root: imgs\n")
    assert load_config(str(saved), [], run_config=True).data.root == "imgs"
    assert load_config(str(saved), []).data.root == str(tmp_path / "imgs")
    hashes = set()
    for spelled in ("w.safetensors", "./w.safetensors", str(tmp_path / "w.safetensors")):
        saved.write_text(f"model:\n  teacher_weights: {spelled}\n")  # as an earlier version saved it
        cfg = load_config(str(saved), [], run_config=True)
        assert cfg.model.teacher_weights == spelled
        hashes.add(result_hash(cfg, ("model.teacher_weights", "teacher"), False))
    assert len(hashes) == 1


def test_a_crop_key_the_augmentation_does_not_read_changes_no_result():
    """data.crop_padding under random_resized_crop (and crop_scale under pad_crop) is read by nothing: changing it
    leaves the result hash, so no finished stage reruns; under the augmentation that reads it, it counts."""
    from compress.run.config import result_hash

    def h(*sets):
        return result_hash(load_config(None, ["data.name=digits", *sets]), ("data", "teacher"), False)

    rrc = "data.augment=random_resized_crop"
    assert h(rrc, "data.crop_padding=8") == h(rrc, "data.crop_padding=4") != h(rrc, "data.crop_scale=[0.5, 1.0]")
    pad = "data.augment=pad_crop"
    assert h(pad, "data.crop_scale=[0.5, 1.0]") == h(pad) != h(pad, "data.crop_padding=8")
    assert h("data.augment=none", "data.crop_padding=8", "data.crop_scale=[0.5, 1.0]") == h("data.augment=none")


def test_a_value_millions_of_characters_long_is_not_echoed_whole(tmp_path):
    """One sentence stays one sentence: the middle of an overlong value is left out, the key and the advice kept."""
    from compress.errors import LONGEST_PROBLEM, ConfigError

    path = tmp_path / "long.yaml"
    path.write_text("data:\n  name: " + "x" * 5_000_000 + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    (problem,) = e.value.problems
    assert len(problem) <= LONGEST_PROBLEM and problem.startswith("data.name: unknown dataset 'xxx")
    assert "characters left out" in problem
    assert problem.endswith("; choose one of mnist5k, digits, cifar10, imagefolder")
