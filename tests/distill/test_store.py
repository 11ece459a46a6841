"""The teacher-output store: top-k packing, self-checking chunks, resumed and extended builds, the key, and
stored outputs that are the live teacher's on the very pixels the student sees."""

import hashlib
import json
import math
import os

import pytest
import torch

from compress.data.datasets import load_data
from compress.distill.objective import make_loss
from compress.distill.store import StoreSpec, TeacherOutputStore, default_top_k, pack_logits, unpack_logits
from compress.distill.teacher import FrozenTeacher
from compress.errors import InputError, Interrupted, StageFailed
from compress.models.registry import build_model
from compress.run.config import load_config
from compress.training import interrupt
from compress.training.distributed import DistEnv
from tests.distill.test_teacher import setup  # the frozen teacher and its student, as built there


def spec(**changes):
    fields = dict(teacher_sha256="a" * 64, teacher_model="resnet8", data_fingerprint="f" * 16, samples=250, views=3,
                  classes=10, top_k=10, augment={"kind": "pad_crop"}, precision="fp32", rows_per_chunk=100)
    return StoreSpec(**{**fields, **changes})


def test_top_k_keeps_the_teachers_top_probabilities_and_spreads_the_rest_evenly():
    logits = torch.tensor([[5.0, 3.0, 1.0, 0.0, -1.0]])
    s = spec(classes=5, top_k=2)
    packed = pack_logits(logits, s)
    assert packed["values"].dtype == torch.float16 and packed["indices"].tolist() == [[0, 1]]
    p = torch.softmax(unpack_logits(packed, s), 1)[0].tolist()
    exact = torch.softmax(logits, 1)[0].tolist()
    assert p[0] == pytest.approx(exact[0], rel=1e-3) and p[1] == pytest.approx(exact[1], rel=1e-3)
    rest = 1 - exact[0] - exact[1]
    assert p[2:] == pytest.approx([rest / 3] * 3, rel=1e-3)
    # every logit kept when there are few classes: nothing but fp16 rounding
    dense = spec(classes=5, top_k=5)
    assert torch.allclose(unpack_logits(pack_logits(logits, dense), dense), logits, atol=1e-2)


def test_bytes_per_image_and_view_at_imagenet_scale():
    s = spec(classes=1000, top_k=10)
    assert s.bytes_per_row() == 10 * 2 + 10 * 2 + 4  # fp16 values, int16 indices, fp32 rest: 44 bytes
    assert spec(classes=10, top_k=10).bytes_per_row() == 20


def test_the_key_ignores_the_number_of_views_and_names_what_changed():
    assert spec(views=3).key == spec(views=40).key
    assert spec(teacher_sha256="b" * 64).key != spec().key
    assert spec().difference({**vars(spec()), "teacher_sha256": "c"}) == "the teacher changed"


def test_the_teachers_code_is_in_the_key_and_a_teacher_without_code_keeps_its_key():
    """The same weights under edited model code give other outputs: a user's teacher (`<module>:<function>`) keys
    its store by its source file's digest too; a registry teacher has none, and its key is the one it had before
    the digest was part of the spec (stores already built stay reused)."""
    assert spec(teacher_code="1" * 64).key != spec(teacher_code="2" * 64).key != spec().key
    assert spec(teacher_code="2" * 64).difference(vars(spec(teacher_code="1" * 64))) == "the teacher's code changed"
    without = {k: v for k, v in vars(spec()).items() if k not in ("views", "teacher_code", "feature_copy")}
    assert spec().key == hashlib.sha256(json.dumps(without).encode()).hexdigest()[:16]


def test_a_store_of_cosine_features_kept_before_they_were_copied_is_rebuilt_and_one_without_keeps_its_key():
    """Cosine features stored before the tap copied its layer's output may hold a later in-place layer's values
    (a ReLU after a batch norm): such a store (no feature_copy in its spec) is rebuilt, saying why; a store of
    logits only keeps its key."""
    with_features = spec(cosine_layer="layer1", cosine_width=64, feature_copy=1)
    before = {k: v for k, v in vars(with_features).items() if k != "feature_copy"}
    assert with_features.difference(before) == ("its cosine features were kept before a later in-place layer could "
                                                 "change them")
    assert spec(feature_copy=0).key == spec().key


@pytest.fixture(scope="module")
def digits():
    cfg = load_config(None, ["data.name=digits", "data.augment=pad_crop", "data.limit=250"])
    data = load_data(cfg.data, 0)
    torch.manual_seed(0)
    teacher = FrozenTeacher(build_model("resnet8", data.input_shape, 10))
    return data, teacher


def build(folder, digits, views=3, **changes):
    data, teacher = digits
    train = data.train.with_augment(views=views, view_seed=1)
    store = TeacherOutputStore(str(folder), spec(data_fingerprint=train.fingerprint(), views=views, **changes))
    plan = store.prepare(DistEnv())
    store.build(teacher, train, DistEnv(), 64, lambda x: x, plan)
    return store, plan, train


def read_chunks(folder):
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder)) if n.startswith("chunk-")}


def test_a_built_store_is_reused_and_a_damaged_chunk_is_found_and_rebuilt(tmp_path, digits):
    folder = tmp_path / "store"
    store, plan, train = build(folder, digits)
    assert plan["status"] == "build" and len(read_chunks(folder)) == 9  # 3 views x 3 blocks of 100
    good = read_chunks(folder)
    assert build(folder, digits)[1]["status"] == "reuse"
    data = bytearray(good["chunk-000004.safetensors"])
    data[-3] ^= 0x01  # one changed bit in the logits
    (folder / "chunk-000004.safetensors").write_bytes(bytes(data))
    (folder / "chunk-000007.safetensors").write_bytes(good["chunk-000007.safetensors"][:200])  # truncated
    _, plan, _ = build(folder, digits)
    assert plan["status"] == "rebuild" and plan["missing"] == [4, 7] and "2 damaged chunk(s)" in plan["reason"]
    assert read_chunks(folder) == good  # rebuilt exactly as before


def test_an_interrupted_build_resumes_where_it_stopped(tmp_path, digits):
    folder = tmp_path / "store"
    build(folder, digits)
    whole = read_chunks(folder)
    for name in ("chunk-000005.safetensors", "chunk-000008.safetensors"):
        os.unlink(folder / name)  # as if killed after chunk 4 was written: store.json as it stood then
    index = json.loads((folder / "store.json").read_text())
    index["views"] = 0
    index["chunks"] = {n: d for n, d in index["chunks"].items() if n not in ("chunk-000005.safetensors",
                                                                             "chunk-000008.safetensors")}
    (folder / "store.json").write_text(json.dumps(index))
    _, plan, _ = build(folder, digits)
    assert plan["status"] == "resume" and plan["missing"] == [5, 8]
    assert read_chunks(folder) == whole


def test_ctrl_c_during_the_build_keeps_the_chunks_written_so_far(tmp_path, digits):
    folder = tmp_path / "store"
    data, teacher = digits
    train = data.train.with_augment(views=3, view_seed=1)
    store = TeacherOutputStore(str(folder), spec(data_fingerprint=train.fingerprint()))
    calls = []

    def teacher_then_ctrl_c(x):
        calls.append(1)
        if len(calls) == 5:  # during the third chunk
            interrupt._requested = True
        return teacher(x)

    try:
        with pytest.raises(Interrupted, match="while computing the teacher's outputs .*rerun the same command to "
                                              "resume the build"):
            store.build(teacher_then_ctrl_c, train, DistEnv(), 64, lambda x: x, store.prepare(DistEnv()))
    finally:
        interrupt._requested = False
    # store.json records every chunk written, and no view complete
    index = json.loads((folder / "store.json").read_text())
    assert 1 <= len(read_chunks(folder)) < 9 and index["views"] == 0 and sorted(index["chunks"]) == sorted(
        read_chunks(folder))
    assert build(folder, digits)[1]["status"] == "resume"


def test_more_views_extend_the_store_and_fewer_reuse_it(tmp_path, digits):
    folder = tmp_path / "store"
    build(folder, digits, views=2)
    two = read_chunks(folder)
    store, plan, train = build(folder, digits, views=3)
    assert plan["status"] == "extend" and plan["missing"] == [6, 7, 8]
    assert {k: v for k, v in read_chunks(folder).items() if k in two} == two
    store, plan, train = build(folder, digits, views=1)
    assert plan["status"] == "reuse"
    store.open()
    batch = train.batch(range(10, 20), epoch=7)  # one view: epoch 7 shows view 0, which the store holds
    assert torch.allclose(store.lookup(batch.index, batch.view, "cpu")["logits"], digits[1](batch.x)["logits"],
                          atol=2e-2)


def test_a_store_of_another_teacher_is_rebuilt_and_says_why(tmp_path, digits):
    folder = tmp_path / "store"
    build(folder, digits)
    _, plan, _ = build(folder, digits, teacher_sha256="b" * 64)
    assert (plan["status"], plan["reason"], plan["wipe"]) == ("rebuild", "the teacher changed", True)


def test_a_store_that_does_not_fit_on_the_disk_is_refused_before_training(tmp_path):
    store = TeacherOutputStore(str(tmp_path / "store"), spec(classes=1000, top_k=10, samples=10**9, views=10**4,
                                                                 rows_per_chunk=10**9))
    with pytest.raises(InputError, match=r"distill: the teacher-output store needs [\d.]+ GB more \(10000 views x "
                                         r"1,000,000,000 images x 44 bytes\) but .* GB free; lower distill.views"):
        store.check_disk(list(range(10**4)))
    assert math.isfinite(store.spec.total_bytes())


def test_logits_beyond_fp16_are_stored_clamped_not_as_inf(tmp_path, digits, caplog):
    """An overconfident teacher (logits near 1e5, seen from a torchvision resnet18 trained one epoch) overflowed
    the fp16 store into inf, and distill then stopped on a NaN loss whose advice (a lower distill.lr) could not
    help. The store keeps such outputs clamped to fp16's largest value and says why."""
    huge = torch.tensor([[1.2e5, -3.0, 70000.0, 2.0]])
    for top_k in (4, 2):
        s = spec(classes=4, top_k=top_k)
        values = unpack_logits(pack_logits(huge, s), s)
        assert torch.isfinite(values).all() and float(values.max()) == 65504.0
        assert torch.isfinite(torch.softmax(values / 4, 1)).all()
    data, teacher = digits
    loud = lambda x: {k: v * 1e7 for k, v in teacher(x).items()}  # noqa: E731
    train = data.train.with_augment(views=1, view_seed=1)
    store = TeacherOutputStore(str(tmp_path / "store"), spec(data_fingerprint=train.fingerprint(), views=1))
    with caplog.at_level("WARNING"):
        store.build(loud, train, DistEnv(), 64, lambda x: x, store.prepare(DistEnv()))
    assert "beyond the store's fp16 range (65,504): the store keeps them clamped" in caplog.text
    store.open()
    batch = train.batch(range(10), epoch=0)
    assert torch.isfinite(store.lookup(batch.index, batch.view, "cpu")["logits"]).all()
    # a store an older version built with inf in it is rebuilt, not reused
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from compress.distill.store import _sha256

    path = store.chunk_path(0)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    tensors["values"][0, 0] = float("inf")  # its checksums made to match: only the values are wrong
    save_file(tensors, path, {**meta, "sha256": json.dumps({k: _sha256(v) for k, v in tensors.items()},
                                                          sort_keys=True)})
    plan = TeacherOutputStore(str(tmp_path / "store"), store.spec).prepare(DistEnv())
    assert plan["status"] == "rebuild" and plan["missing"] == [0]


def test_a_teacher_whose_outputs_are_not_finite_is_named_and_nothing_is_stored(tmp_path, digits):
    data, teacher = digits

    def broken(x):
        out = teacher(x)
        out["logits"][0, 0] = float("nan")
        return out

    train = data.train.with_augment(views=1, view_seed=1)
    folder = tmp_path / "store"
    store = TeacherOutputStore(str(folder), spec(data_fingerprint=train.fingerprint(), views=1))
    with pytest.raises(StageFailed, match=r"distill: the teacher's outputs are not finite \(NaN or inf\) for 1 "
                                          r"training image\(s\): the teacher checkpoint is broken.*the store "
                                          r"is left unfinished"):
        store.build(broken, train, DistEnv(), 256, lambda x: x, store.prepare(DistEnv()))
    assert not read_chunks(folder) and not (folder / "store.json").exists()
    # computed in fp16 (a GPU without bf16), the overflow is the precision's, not a broken checkpoint's
    store = TeacherOutputStore(str(tmp_path / "fp16"), spec(data_fingerprint=train.fingerprint(), views=1,
                                                             precision="fp16"))
    with pytest.raises(StageFailed, match=r"for 1 training image\(s\) in fp16, the precision this run computes it in: "
                                          r"its outputs overflow fp16's range - set train.precision to fp32"):
        store.build(broken, train, DistEnv(), 256, lambda x: x, store.prepare(DistEnv()))


def test_non_finite_outputs_in_a_later_chunk_leave_the_store_unfinished_and_a_good_teacher_resumes_it(tmp_path,
                                                                                                    digits):
    data, teacher = digits
    calls = []

    def breaks_later(x):
        calls.append(1)
        out = teacher(x)
        if len(calls) == 3:  # the third chunk (one batch per chunk of 100 rows)
            out["logits"][0, 0] = float("inf")
        return out

    train = data.train.with_augment(views=1, view_seed=1)
    folder = tmp_path / "store"
    store = TeacherOutputStore(str(folder), spec(data_fingerprint=train.fingerprint(), views=1))
    with pytest.raises(StageFailed, match="the store is left unfinished"):
        store.build(breaks_later, train, DistEnv(), 128, lambda x: x, store.prepare(DistEnv()))
    assert sorted(read_chunks(folder)) == ["chunk-000000.safetensors", "chunk-000001.safetensors"]
    assert json.loads((folder / "store.json").read_text())["views"] == 0  # unfinished
    store = TeacherOutputStore(str(folder), spec(data_fingerprint=train.fingerprint(), views=1))
    plan = store.prepare(DistEnv())
    assert plan["status"] == "resume" and plan["missing"] == [2]  # the finite chunks are kept and reused
    store.build(teacher, train, DistEnv(), 128, lambda x: x, plan)
    assert (folder / "store.json").exists()


def forge(path):
    """Rewrite a chunk consistently: other logits, and its own per-tensor hashes updated to match them."""
    from safetensors.torch import load

    from compress.training.checkpoint import serialize, tensor_sha256

    data = path.read_bytes()
    tensors = load(data)
    meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    tensors["values"] = tensors["values"].flip(1).contiguous()  # every image's classes swapped around
    meta["sha256"] = json.dumps({k: tensor_sha256(v) for k, v in tensors.items()}, sort_keys=True)
    path.write_bytes(serialize(tensors, meta))


def test_a_chunk_rewritten_with_its_own_hashes_updated_is_rebuilt_not_reused(tmp_path, digits):
    """Each chunk is checked against the digest store.json recorded when it was built, not only the hashes in its
    own header, so a chunk rewritten with its header updated is rebuilt, not reused."""
    folder = tmp_path / "store"
    build(folder, digits)
    good = read_chunks(folder)
    forge(folder / "chunk-000004.safetensors")
    _, plan, _ = build(folder, digits)
    assert plan["status"] == "rebuild" and plan["missing"] == [4]
    assert "1 damaged chunk(s) (chunk-000004.safetensors, ...) rebuilt: their bytes are not what store.json " \
        "recorded when they were built" == plan["reason"]
    assert read_chunks(folder) == good


def test_a_chunk_store_json_does_not_record_is_not_trusted(tmp_path, digits):
    folder = tmp_path / "store"
    build(folder, digits)
    forge(folder / "chunk-000002.safetensors")
    index = json.loads((folder / "store.json").read_text())
    del index["chunks"]["chunk-000002.safetensors"]  # its record gone too
    index["views"] = 0
    (folder / "store.json").write_text(json.dumps(index))
    _, plan, _ = build(folder, digits)
    assert plan["status"] == "resume" and plan["missing"] == [2]


@pytest.mark.parametrize("views", [10**12, -1, "3", None])
def test_a_store_json_whose_views_cannot_be_is_one_sentence_and_a_rebuild(tmp_path, digits, views):
    """A store.json claiming views that cannot be (such as 10^12) is one sentence and a rebuild, never reused or
    extended chunk by chunk."""
    folder = tmp_path / "store"
    build(folder, digits)
    index = json.loads((folder / "store.json").read_text())
    index["views"] = views
    (folder / "store.json").write_text(json.dumps(index))
    store, plan, _ = build(folder, digits)
    assert plan["status"] == "rebuild" and plan["wipe"] and plan["reason"] in (
        "its store.json claims 1,000,000,000,000 complete views but records 9 chunk(s)",
        "its store.json has no valid views and chunks")
    assert json.loads((folder / "store.json").read_text())["views"] == 3


def store_for(tmp_path, cfg, data, teacher, train_set, top_k=None):
    a = train_set.augment
    spec = StoreSpec("0" * 64, cfg.model.teacher, train_set.fingerprint(), len(train_set), a.views, 10,
                     default_top_k(10, top_k), {"kind": a.kind, "flip": a.flip, "view_seed": a.view_seed}, "fp32",
                     teacher.stored_layer, teacher.stored_width, rows_per_chunk=100)
    store = TeacherOutputStore(str(tmp_path / "store"), spec)
    plan = store.prepare(DistEnv())
    store.build(teacher, train_set, DistEnv(), 64, lambda x: x, plan)
    return store.open(), plan


def test_stored_and_live_teacher_give_the_same_loss(tmp_path):
    cfg, data, teacher, student = setup(hint=False)
    train_set = data.train.with_augment(views=1)
    store, plan = store_for(tmp_path, cfg, data, teacher, train_set)
    assert plan["status"] == "build" and store.spec.chunks == -(-len(train_set) // 100)
    batch = train_set.batch(range(0, 64, 2), epoch=0)
    student.train()
    stored_loss, stored_parts = make_loss(cfg.distill, student, teacher, store, 10)(batch, 0)
    live_loss, live_parts = make_loss(cfg.distill, student, teacher, None, 10)(batch, 0)
    assert set(stored_parts) == {"ce", "kd", "cosine"}
    # the store keeps fp16: the same loss to fp16's resolution
    assert stored_loss.item() == pytest.approx(live_loss.item(), rel=1e-3)
    for k in stored_parts:
        assert stored_parts[k] == pytest.approx(live_parts[k], rel=1e-3, abs=1e-4)


def test_stored_views_are_the_teacher_outputs_of_the_very_pixels_the_student_sees(tmp_path):
    """Consistent teaching: for any epoch, the stored outputs looked up by (sample, view) are the teacher's
    outputs on exactly the augmented (and mixed) images of the batch."""
    cfg, data, teacher, student = setup("data.augment=pad_crop", hint=False)
    train_set = data.train.with_augment(views=3, view_seed=5, mix="cutmix")
    store, _ = store_for(tmp_path, cfg, data, teacher, train_set)
    for epoch in (0, 1, 5):
        batch = train_set.batch(range(40, 72), epoch=epoch)
        assert set(batch.view.tolist()) == {epoch % 3}
        stored = store.lookup(batch.index, batch.view, "cpu")
        live = teacher(batch.x)
        for key in ("logits", "cosine"):
            assert torch.allclose(stored[key], live[key].float(), atol=2e-2, rtol=1e-2), key


def forge_layout(folder, name, change, header=None):
    """Rewrite chunk `name` with `change` applied to its tensors, its header's hashes (or `header`'s text) and
    the digest store.json records for it both made to match: only the tensors' names, shapes or dtypes (or the
    header) give it away."""
    from safetensors.torch import load

    from compress.training.checkpoint import serialize, tensor_sha256

    data = (folder / name).read_bytes()
    tensors = load(data)
    meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    tensors = {k: v.contiguous() for k, v in change(tensors).items()}
    meta["sha256"] = header or json.dumps({k: tensor_sha256(v) for k, v in tensors.items()}, sort_keys=True)
    (folder / name).write_bytes(serialize(tensors, meta))
    index = json.loads((folder / "store.json").read_text())
    index["chunks"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "store.json").write_text(json.dumps(index))


@pytest.mark.parametrize("top_k, change", [
    (10, lambda t: {**t, "values": t["values"][:, :7]}),  # fewer classes than the store's
    (10, lambda t: {k: v[:60] for k, v in t.items()}),  # fewer rows than the chunk's images
    (10, lambda t: {**t, "values": t["values"].float()}),  # another dtype
    (10, lambda t: {**t, "values": t["values"].to(torch.int16)}),
    (10, lambda t: {**t, "extra": torch.zeros(100)}),  # a tensor the store does not hold
    (3, lambda t: {**t, "indices": t["indices"].long()}),
    (3, lambda t: {k: v for k, v in t.items() if k != "rest"}),
], ids=["classes", "rows", "float32", "int16", "extra", "indices-int64", "no-rest"])
def test_a_chunk_whose_tensors_are_not_the_specs_is_rebuilt_even_with_every_digest_matching(tmp_path, digits, top_k,
                                                                                           change):
    """A chunk is checked against what the store's spec says it holds - each tensor's name, rows, width and dtype
    - not only against its digests, so one of other shapes or dtypes whose digests were all made to match is
    rebuilt, never handed to the distill stage to fail on."""
    folder = tmp_path / "store"
    build(folder, digits, top_k=top_k)
    good = read_chunks(folder)
    forge_layout(folder, "chunk-000004.safetensors", change)
    _, plan, _ = build(folder, digits, top_k=top_k)
    assert plan["status"] == "rebuild" and plan["missing"] == [4]
    assert plan["reason"] == ("1 damaged chunk(s) (chunk-000004.safetensors, ...) rebuilt: their tensors are not "
                              "the names, shapes and dtypes this store holds")
    assert read_chunks(folder) == good


@pytest.mark.parametrize("header", ['["values", "indices"]', "7", "null"])
def test_a_chunk_whose_header_hashes_are_not_a_mapping_is_rebuilt(tmp_path, digits, header):
    """A chunk whose header's 'sha256' is JSON but not a mapping of tensor names, with store.json's digest made to
    match, is rebuilt (it was an unexpected TypeError)."""
    folder = tmp_path / "store"
    build(folder, digits)
    good = read_chunks(folder)
    forge_layout(folder, "chunk-000004.safetensors", lambda t: t, header=header)
    _, plan, _ = build(folder, digits)
    assert plan["status"] == "rebuild" and plan["missing"] == [4], plan
    assert read_chunks(folder) == good
