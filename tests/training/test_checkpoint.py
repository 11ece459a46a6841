"""Checkpoints in safetensors + JSON (compress.training.checkpoint): exact round trips, the DDP wrapper
unwrapped, damage and mismatches refused, the training state restored."""

import json

import pytest
import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as DDP

from compress.errors import CheckpointError
from compress.fileio import sha256_file
from compress.models.registry import build_model
from compress.quant import fx as quant
from compress.training.checkpoint import (
    load_training_state,
    load_weights,
    read_metadata,
    read_safetensors,
    read_weights,
    save_training_state,
    save_weights,
    serialize,
)


def small(seed=0):
    torch.manual_seed(seed)
    return build_model("light_cnn", (1, 8, 8), 10)


def test_round_trip_is_exact_and_carries_metadata(tmp_path):
    model, path = small(), tmp_path / "m.safetensors"
    save_weights(path, model, {"stage": "teacher", "model": "light_cnn", "input_shape": [1, 8, 8]})
    other = small(seed=1)
    meta = load_weights(other, path, expect_stage="teacher", expect_model="light_cnn")
    assert meta["input_shape"] == [1, 8, 8]
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)


def test_ddp_wrapper_is_unwrapped_before_saving(tmp_path):
    store = tdist.HashStore()
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        path = tmp_path / "ddp.safetensors"
        save_weights(path, DDP(small()), {"stage": "teacher", "model": "light_cnn"})
    finally:
        tdist.destroy_process_group()
    tensors, _ = read_weights(path)
    assert tensors and not any(k.startswith(("module.", "_orig_mod.")) for k in tensors)


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "m.safetensors"
    save_weights(path, small(), {"stage": "teacher", "model": "light_cnn"})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
        load_weights(small(), path)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    save_weights(path, small(), {"stage": "teacher", "model": "light_cnn"})
    with pytest.raises(CheckpointError, match="holds a 'light_cnn' model but the config asks for 'deep_cnn'"):
        load_weights(build_model("deep_cnn", (1, 8, 8), 10), path, expect_model="deep_cnn")
    with pytest.raises(CheckpointError, match="does not fit the model: missing keys"):
        load_weights(build_model("deep_cnn", (1, 8, 8), 10), path)


def test_edited_bytes_are_caught_by_the_manifest_sha(tmp_path):
    path = tmp_path / "m.safetensors"
    save_weights(path, small(), {"stage": "teacher", "model": "light_cnn"})
    sha = sha256_file(path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="modified after it was written"):
        read_weights(path, expect_sha256=sha)


def test_wrong_dtype_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    save_weights(path, small().half(), {"stage": "teacher", "model": "light_cnn"})
    with pytest.raises(CheckpointError, match="wrong dtype"):
        load_weights(small(), path)


def test_training_state_restores_optimizer_exactly(tmp_path):
    model = small()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 1, 8, 8)).sum().backward()
        opt.step()
    path = tmp_path / "last.safetensors"
    save_training_state(path, {"model": model}, opt, {"epoch": 2, "step": 5, "history": [{"a": 1}]})
    model2 = small(seed=3)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    state = load_training_state(path, {"model": model2}, opt2)
    assert state == {"epoch": 2, "step": 5, "history": [{"a": 1}]}
    assert read_metadata(path)["state"]["epoch"] == 2
    for k, v in opt.state_dict()["state"].items():
        for name, tensor in v.items():
            assert torch.equal(tensor, opt2.state_dict()["state"][k][name])
    assert json.dumps(opt.state_dict()["param_groups"]) == json.dumps(opt2.state_dict()["param_groups"])


def test_the_optimizers_hyperparameters_are_the_configs_not_the_files(tmp_path):
    """A resume takes the optimizer's accumulated state from the file, its hyperparameters from the optimizer the
    config built: a file edited to momentum -5 trained to NaN under "lower teacher.lr" advice."""
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5, weight_decay=0.3)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    opt.step()
    path = tmp_path / "last.safetensors"
    save_training_state(path, {"model": model}, opt, {"epoch": 1, "step": 0, "history": []})
    model2 = small(seed=3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9, weight_decay=0.0)
    load_training_state(path, {"model": model2}, opt2)
    group = opt2.param_groups[0]
    assert (group["momentum"], group["weight_decay"]) == (0.9, 0.0)
    buffers = [opt2.state[p]["momentum_buffer"] for p in group["params"]]
    assert all(torch.equal(b, opt.state[p]["momentum_buffer"]) for b, p in zip(buffers, opt.param_groups[0]["params"]))


def test_qat_state_with_shared_tensors_saves_and_reloads(tmp_path):
    example = torch.randn(2, 1, 8, 8)
    prepared = quant.prepare(small(), example)
    prepared(torch.randn(16, 1, 8, 8))
    path = tmp_path / "qat.safetensors"
    save_weights(path, prepared, {"stage": "qat", "model": "light_cnn"})
    tensors, _ = read_weights(path)
    qconfig = {"backend": "x86", "activation_range": "full", "per_channel": True, "float_layers": []}
    rebuilt = quant.rebuild_int8(small(seed=5), tensors, example, qconfig, path)
    x = torch.randn(8, 1, 8, 8)
    assert torch.equal(quant.convert(prepared)(x), rebuilt(x))


def test_a_resume_checkpoint_that_does_not_fit_the_model_says_how_to_start_the_stage_over(tmp_path):
    """A checkpoint whose tensors no longer fit (here one written without the layout that `compress.run.state`
    checks before resuming, so the load itself finds it) names the stage's last/ folder and --force."""
    model = small()
    path = tmp_path / "teacher" / "last" / "checkpoint.safetensors"
    save_training_state(path, {"model": model}, torch.optim.SGD(model.parameters(), lr=0.1),
                        {"epoch": 1, "step": 0, "history": []})
    tensors, meta = read_safetensors(path)
    meta.pop("layout", None)
    tensors["model.classifier.3.weight"] = torch.zeros(11, 256)
    path.write_bytes(serialize(tensors, meta))
    other = small(seed=1)
    with pytest.raises(CheckpointError) as e:
        load_training_state(path, {"model": other}, torch.optim.SGD(other.parameters(), lr=0.1))
    assert str(e.value) == (
        f"resume checkpoint '{path}' does not fit the model: size mismatch for classifier.3.weight: copying a param "
        "with shape torch.Size([11, 256]) from checkpoint, the shape in current model is torch.Size([10, 256]); "
        f"delete {path.parent}/ (or rerun with --force) to start the stage over")


@pytest.mark.parametrize("optimizer, why", [
    ("{{{", "its 'optimizer' metadata is not JSON"),
    (json.dumps({"param_groups": {}, "scalars": {}}), "its optimizer's 'param_groups' is not a list of mappings"),
    (json.dumps({"param_groups": [], "scalars": {"x.step": 1}}), "its optimizer state 'x.step' is not "
                                                                   "'<parameter index>.<name>'")])
def test_a_resume_checkpoint_whose_optimizer_record_is_damaged_starts_over(tmp_path, optimizer, why):
    """A damaged optimizer record is damaged resume state: planning (`compress.run.state.read_resume`, which
    `run`, `run --dry-run` and `show` share) starts the stage over, naming the file, and a load that meets it
    anyway refuses in one sentence before changing the model - not an "unexpected JSONDecodeError"."""
    from compress.run.rundir import RunDir
    from compress.run.state import checkpoint_rel, read_resume
    from compress.training.checkpoint import resume_tensors_problem

    run, rel = RunDir(tmp_path / "run"), checkpoint_rel("teacher")
    path = tmp_path / "run" / rel
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    opt.step()
    save_training_state(path, {"model": model}, opt, {"stage": "teacher", "config_hash": "c", "inputs": {},
                                                      "epoch": 1, "step": 0, "history": [{"val_acc": 1.0}]})
    assert read_resume(run, "teacher")[0] is not None  # sound as written
    tensors, meta = read_safetensors(path)
    path.write_bytes(serialize(tensors, {**meta, "optimizer": optimizer}))

    assert read_resume(run, "teacher") == (None, f"the resume checkpoint ({rel}) is damaged ({why})")
    assert resume_tensors_problem(path, json.loads(meta["layout"])) == f"is damaged ({why})"
    other = small(seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as e:
        load_training_state(path, {"model": other}, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    assert str(e.value) == (f"resume checkpoint '{path}' is damaged ({why}); delete {path.parent}/ (or rerun with "
                            "--force) to start the stage over")
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_a_resume_step_or_epoch_beyond_any_schedule_is_damaged_without_the_data():
    """Whether a step fits an epoch needs the data (the run checks it); 10**30 steps fits none, so the plan can
    say so as the run would."""
    from compress.training.checkpoint import resume_state_problem

    state = {"epoch": 1, "step": 10**30, "history": [], "config_hash": "x"}
    assert resume_state_problem(state) == "'step' is a 31-digit number, beyond any schedule"
    assert resume_state_problem({**state, "step": 3, "epoch": 10**12}) == "'epoch' is a 13-digit number, beyond " \
        "any schedule"
    assert "401-digit" in resume_state_problem({**state, "epoch": 10**400})  # past a float: no OverflowError
    assert resume_state_problem({**state, "step": 3}) is None


def test_a_resume_state_with_text_for_an_accuracy_or_json_nested_too_deep_is_damaged():
    """An accuracy that is text (its best would compare a float with a str) and JSON nested 100,000 deep (a
    RecursionError in the parser) are a damaged checkpoint, said as one, not 'unexpected ...'."""
    from compress.training.checkpoint import _decode, optimizer_problem, resume_state_problem

    state = {"epoch": 1, "step": 0, "history": [{"val_acc": "98"}], "config_hash": "x"}
    assert resume_state_problem(state) == "'history' is not a list of epoch metrics (each with a finite val_acc)"
    assert "history" in resume_state_problem({**state, "history": [{"val_acc": float("nan")}]})
    assert resume_state_problem({**state, "history": [{"val_acc": 98.0}]}) is None
    assert "'running'" in resume_state_problem({**state, "history": [], "running": {"loss": 1.0}})  # no images
    deep = "[" * 100_000 + "]" * 100_000
    assert _decode(deep) == deep  # kept as text, which is no mapping: refused as damaged
    assert resume_state_problem(_decode(deep)) == "its state is not a mapping"
    assert optimizer_problem(deep, {}) == "its 'optimizer' metadata is not JSON"
