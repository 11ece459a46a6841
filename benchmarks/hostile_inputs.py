"""Hostile input, case by case, through the installed `compress`: each case is built in a scratch folder, the command
run under a time limit, and its exit code, wall time and last line printed as a Markdown table - what a user sees
today. The tests (named in the last column) pin each behaviour; this script shows them side by side.

    python benchmarks/hostile_inputs.py --work /tmp/hostile > /tmp/hostile.md     # about 5 minutes on 2 cores

A case passes when the command ends within the limit, exits as expected (non-zero for input it cannot use), prints
no traceback and no raw control character, and says what the case is about (the `expect` text).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

LIMIT_S = 60
TINY = """\
seed: 0
data: {name: digits, augment: pad_crop, crop_padding: 1}
model: {teacher: resnet14, student: compact_cnn}
train: {eval_batch_size: 256, progress: false}
teacher: {epochs: 2, batch_size: 32}
distill: {epochs: 1, batch_size: 32, views: 3}
qat: {epochs: 1, batch_size: 32, max_accuracy_drop: 100.0, float_layers: []}
export: {latency_batch_sizes: [1, 8], latency_repeats: 2, latency_warmup: 0, min_int8_speedup: 0.0}
"""
PHOTOS = ["-c", "photos", "--set", "model.teacher=resnet14", "--set", "model.student=compact_cnn", "--set",
          "teacher.epochs=1", "--set", "distill.epochs=1", "--set", "distill.views=1", "--set", "qat.epochs=1",
          "--set", "train.progress=false", "--set", "data.image_size=32"]
EXE = os.path.join(os.path.dirname(sys.executable), "compress")
CASES = []


def case(group, name, expect, rc, test):
    def register(build):
        CASES.append((group, name, expect, rc, test, build))
        return build
    return register


def run(args, cwd=None, timeout=LIMIT_S, env=None):
    """(exit code or 'hang', seconds, stdout + stderr) of `compress args` in its own process group."""
    start = time.perf_counter()
    proc = subprocess.Popen([EXE, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=cwd, start_new_session=True, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = "hang"
    return code, time.perf_counter() - start, out


def photos_tree(root, classes=("cat", "dog"), train=8, val=4, shade=0):
    from PIL import Image

    for s, (split, count) in enumerate((("train", train), ("val", val))):
        for c, name in enumerate(classes):
            os.makedirs(os.path.join(root, split, name), exist_ok=True)
            for i in range(count):  # every image its own colour: no validation image copies a training one
                Image.new("RGB", (48 + i, 40), (40 * c + 3 * i, 90 + 50 * s, 160 - 5 * i - 40 * shade)).save(
                    os.path.join(root, split, name, f"{i}.jpg"))
    return root


def copy_run(w, name):
    dst = os.path.join(w, name)
    shutil.copytree(os.path.join(w, "base"), dst, symlinks=True)
    return dst


def with_verdict(w, name, **fields):
    """A copy of the base run whose export.json verdict has `fields` changed."""
    run_dir = copy_run(w, name)
    edit_json(os.path.join(run_dir, "export", "export.json"), lambda d: {**d, "verdict": {**d["verdict"], **fields}})
    return run_dir


def edit_json(path, change):
    with open(path) as f:
        data = json.load(f)
    data = change(data)
    with open(path, "w") as f:
        json.dump(data, f)


def int8_with_metadata(w, name, key, value):
    """A copy of the base run's int8 ONNX file, w/<name>.onnx, with its compress.<key> metadata set to `value`."""
    import onnx

    proto = onnx.load(os.path.join(w, "base", "export", "model.int8.onnx"))
    for prop in proto.metadata_props:
        if prop.key == f"compress.{key}":
            prop.value = value
    path = os.path.join(w, f"{name}.onnx")
    onnx.save(proto, path)
    return path


# -- hangs -------------------------------------------------------------------------------------------------------

@case("hang", "data.unlabeled holding two links to itself (`ln -s . l1; ln -s . l2`)", "unlabelled", 0,
      "tests/data/test_imagefolder.py")
def self_linked_unlabeled(w):
    root = photos_tree(os.path.join(w, "photos_sl"))
    extra = photos_tree(os.path.join(w, "extra_sl"), classes=("x",), train=6, val=0, shade=1)
    unl = os.path.join(extra, "train", "x")
    os.symlink(".", os.path.join(unl, "l1"))
    os.symlink(".", os.path.join(unl, "l2"))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_sl"), "--stages", "teacher,distill", "--set",
            f"data.root={root}", "--set", f"data.unlabeled={unl}"]


@case("hang", "YAML alias bomb (9 levels of 9 aliases) in -c", "alias", 2, "tests/run/test_config.py")
def alias_bomb(w):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i-1}'] * 9)}]" for i in range(1, 10)]
    path = os.path.join(w, "bomb.yaml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return ["run", "-c", path, "--run-dir", os.path.join(w, "r_bomb")]


@case("hang", "alias bomb in a run directory's config.yaml", "alias", 2, "tests/run/test_config.py")
def alias_bomb_in_run(w):
    run_dir = copy_run(w, "r_bomb_run")
    shutil.copy(os.path.join(w, "bomb.yaml"), os.path.join(run_dir, "config.yaml"))
    return ["run", "--run-dir", run_dir]


@case("hang", "a FIFO as <run>/.lock: `compress show`", "teacher  ", 0, "tests/run/test_rundir.py")
def fifo_lock_show(w):
    run_dir = copy_run(w, "r_fifo_lock")
    os.mkfifo(os.path.join(run_dir, ".lock"))
    return ["show", run_dir]


@case("hang", "a FIFO as <run>/.lock: `compress run`", ".lock", 2, "tests/run/test_rundir.py")
def fifo_lock_run(w):
    return ["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", os.path.join(w, "r_fifo_lock")]


@case("hang", "a FIFO as <run>/log.txt", "log.txt", 2, "tests/run/test_rundir.py")
def fifo_log(w):
    run_dir = copy_run(w, "r_fifo_log")
    os.remove(os.path.join(run_dir, "log.txt"))
    os.mkfifo(os.path.join(run_dir, "log.txt"))
    return ["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", run_dir]


@case("hang", "a FIFO named like an image in data.root (even `--dry-run`)", "a pipe", 2,
      "tests/data/test_imagefolder.py")
def fifo_image(w):
    root = photos_tree(os.path.join(w, "photos_fifo"))
    os.mkfifo(os.path.join(root, "train", "cat", "odd.jpg"))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_fifo_img"), "--set", f"data.root={root}", "--dry-run"]


@case("hang", "a link to /dev/zero named like an image in data.root", "a device", 2, "tests/data/test_imagefolder.py")
def zero_image(w):
    root = photos_tree(os.path.join(w, "photos_zero"))
    os.symlink("/dev/zero", os.path.join(root, "train", "cat", "zero.jpg"))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_zero_img"), "--set", f"data.root={root}"]


@case("hang", "YAML nested 3,000 brackets deep in -c", "nest", 2, "tests/run/test_config.py")
def deep_yaml(w):
    path = os.path.join(w, "deep.yaml")
    with open(path, "w") as f:
        f.write("data:\n  mean: " + "[" * 3000 + "]" * 3000 + "\n")
    return ["config", "-c", path]


# -- silent wrong results ----------------------------------------------------------------------------------------

@case("wrong result", "data.unlabeled = the data root", "unlabeled", 2, "tests/data/test_imagefolder.py")
def unlabeled_root(w):
    root = photos_tree(os.path.join(w, "photos_ur"))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_ur"), "--set", f"data.root={root}", "--set",
            f"data.unlabeled={root}"]


@case("wrong result", "data.unlabeled = the data root's val/", "unlabeled", 2, "tests/data/test_imagefolder.py")
def unlabeled_val(w):
    root = os.path.join(w, "photos_ur")
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_uv"), "--set", f"data.root={root}", "--set",
            f"data.unlabeled={root}/val"]


@case("wrong result", "a store chunk rewritten with its own hashes updated", "rebuilt", 0,
      "tests/distill/test_store.py")
def forged_chunk(w):
    from safetensors.torch import load

    from compress.training.checkpoint import serialize, tensor_sha256

    run_dir = copy_run(w, "r_forged")
    path = os.path.join(run_dir, "distill", "teacher_outputs", "chunk-000000.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    tensors = load(data)
    meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    tensors["values"] = tensors["values"].flip(1).contiguous()
    meta["sha256"] = json.dumps({k: tensor_sha256(v) for k, v in tensors.items()}, sort_keys=True)
    with open(path, "wb") as f:
        f.write(serialize(tensors, meta))
    return ["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", run_dir, "--stages", "distill", "--force"]


# -- unsafe ------------------------------------------------------------------------------------------------------

@case("unsafe", "export.json's verdict file `../../../elsewhere/evil.onnx`: `compress predict`", "export/", 2,
      "tests/deploy/test_export_report.py")
def verdict_outside(w):
    run_dir = with_verdict(w, "r_evil", file="../../../elsewhere/evil.onnx")
    os.makedirs(os.path.join(w, "elsewhere"), exist_ok=True)
    shutil.copy(os.path.join(run_dir, "export", "model.int8.onnx"), os.path.join(w, "elsewhere", "evil.onnx"))
    return ["predict", run_dir, os.path.join(w, "digit.png")]


@case("unsafe", "export.json's verdict file `/etc/passwd`: `compress predict`", "export/", 2,
      "tests/deploy/test_export_report.py")
def verdict_passwd(w):
    return ["predict", with_verdict(w, "r_passwd", file="/etc/passwd"), os.path.join(w, "digit.png")]


@case("unsafe", "terminal escapes in export.json's `why`: `compress show`", "\\x1b]0;owned", 0,
      "tests/test_fileio.py")
def escapes_why(w):
    return ["show", with_verdict(w, "r_esc", why="\x1b]0;owned\x07\x1b[2J cleared")]


@case("unsafe", "a class folder named with an escape sequence", "classes", 0, "tests/test_fileio.py")
def escapes_class(w):
    root = photos_tree(os.path.join(w, "photos_esc"), classes=("cat", "\x1b[31mred"))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_escc"), "--stages", "teacher", "--set", f"data.root={root}",
            "--set", "teacher.epochs=1", "--dry-run"]


# -- "unexpected ..." where one sentence was due -----------------------------------------------------------------

@case("one sentence", "report.md is a folder: `compress report`", "report.md", 2, "tests/test_fileio.py")
def output_is_folder(w):
    run_dir = copy_run(w, "r_folder")
    os.remove(os.path.join(run_dir, "report.md"))
    os.mkdir(os.path.join(run_dir, "report.md"))
    return ["report", run_dir]


@case("one sentence", "export.json is a list: `compress predict`", "export.json", 2,
      "tests/deploy/test_export_report.py")
def export_list(w):
    run_dir = copy_run(w, "r_list")
    with open(os.path.join(run_dir, "export", "export.json"), "w") as f:
        json.dump([1, 2], f)
    return ["predict", run_dir, os.path.join(w, "digit.png")]


@case("one sentence", "a verdict without `file`: `compress predict`", "file", 2,
      "tests/deploy/test_export_report.py")
def verdict_no_file(w):
    run_dir = copy_run(w, "r_nofile")
    edit_json(os.path.join(run_dir, "export", "export.json"),
              lambda d: {**d, "verdict": {k: v for k, v in d["verdict"].items() if k != "file"}})
    return ["predict", run_dir, os.path.join(w, "digit.png")]


@case("one sentence", "a manifest metric of the wrong type: `compress show`", "not a number", 2,
      "tests/run/test_rundir.py")
def metric_type(w):
    run_dir = copy_run(w, "r_metric")

    def change(m):
        m["stages"]["teacher"]["metrics"]["val_acc"] = {"not": "a number"}
        return m
    edit_json(os.path.join(run_dir, "manifest.json"), change)
    return ["show", run_dir]


@case("one sentence", "store.json claiming 10^12 views", "store.json", 0, "tests/distill/test_store.py")
def store_views(w):
    run_dir = copy_run(w, "r_views")
    edit_json(os.path.join(run_dir, "distill", "teacher_outputs", "store.json"), lambda d: {**d, "views": 10**12})
    return ["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", run_dir, "--stages", "distill", "--force"]


@case("one sentence", "an ONNX resize that disagrees with the graph's input: `compress predict`", "compress.resize",
      2, "tests/deploy/test_onnx_model.py")
def onnx_resize(w):
    resize = {"shorter_side": 16, "height": 16, "width": 16, "interpolation": "bilinear", "antialias": True,
              "crop": "center"}
    path = int8_with_metadata(w, "resized", "resize", json.dumps(resize))
    return ["predict", path, os.path.join(w, "digit.png")]


@case("wrong result", "`--set data=` beside -c photos (every data key, data.root too, back to the defaults)",
      "is a section", 2, "tests/run/test_config.py")
def empty_section(w):
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_empty_section"), "--set", "data=", "--dry-run"]


@case("wrong result", "an edited export.json's figures in `compress report`", "export.json changed", 0,
      "tests/cli/test_deploy_cmds.py")
def report_of_edited_export(w):
    run_dir = copy_run(w, "r_edited_export")
    edit_json(os.path.join(run_dir, "export", "export.json"),
              lambda d: {**d, "int8": {**d["int8"], "onnx_acc": 100.0}})
    return ["report", run_dir]


@case("lost", "`compress eval RUN FOLDER --png RUN/report.png` (the run's own chart)", "run directory", 2,
      "tests/deploy/test_evaluate.py")
def png_over_report(w):
    run_dir = os.path.join(w, "base")
    folder = os.path.join(w, "eval_tree", "3")
    os.makedirs(folder, exist_ok=True)
    shutil.copy(os.path.join(w, "digit.png"), folder)
    return ["eval", run_dir, os.path.dirname(folder), "--png", os.path.join(run_dir, "report.png")]


@case("message", "an unreadable image under `--nproc-per-node 2 --max-restarts 2` (said once, not retried)",
      "cannot read image", 2, "tests/training/test_distributed.py")
def restarts_on_bad_input(w):
    root = photos_tree(os.path.join(w, "photos_broken"))
    with open(os.path.join(root, "train", "cat", "broken.jpg"), "wb") as f:
        f.write(b"not an image")
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_restarts"), "--stages", "teacher", "--set",
            f"data.root={root}", "--nproc-per-node", "2", "--max-restarts", "2"]


@case("one sentence", "a class folder whose name is not UTF-8 (`d\\xf6g`)", "not UTF-8", 2,
      "tests/data/test_imagefolder.py")
def class_not_utf8(w):
    root = photos_tree(os.path.join(w, "photos_latin1"))
    for split in ("train", "val"):
        os.rename(os.path.join(root, split, "dog"), os.fsdecode(os.path.join(os.fsencode(root), split.encode(),
                                                                             b"d\xf6g")))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_latin1"), "--set", f"data.root={root}"]


@case("one sentence", "images whose names are not UTF-8 (`0-caf\\xe9.jpg`): read", "report:", 0,
      "tests/data/test_imagefolder.py")
def images_not_utf8(w):
    root = photos_tree(os.path.join(w, "photos_latin1_files"))
    for folder, _, names in os.walk(root):
        for name in names:
            os.rename(os.path.join(folder, name), os.fsdecode(os.fsencode(os.path.join(folder, name))
                                                              .replace(b".jpg", b"-caf\xe9.jpg")))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_latin1_files"), "--set", f"data.root={root}"]


@case("one sentence", "a run directory whose name is not UTF-8", "not UTF-8", 2, "tests/run/test_rundir.py")
def run_dir_not_utf8(w):
    return ["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir",
            os.fsdecode(os.path.join(os.fsencode(w), b"r_\xff"))]


# -- messages ----------------------------------------------------------------------------------------------------

@case("message", "a limit out of range (`--set distill.kd.temperature=0`)", "temperature", 2,
      "tests/run/test_config.py")
def limit_both_ends(w):
    return ["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", os.path.join(w, "r_lim"), "--set",
            "distill.kd.temperature=0", "--dry-run"]


@case("message", "a degenerate normalisation (`--set data.std=[0]`)", "data.std", 2, "tests/run/test_config.py")
def degenerate_std(w):
    return ["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", os.path.join(w, "r_std"), "--set",
            "data.std=[0]", "--dry-run"]


@case("hang", "a device as the config file (`-c /dev/zero`)", "not a regular file", 2, "tests/run/test_config.py")
def config_device(w):
    return ["run", "-c", "/dev/zero", "--run-dir", os.path.join(w, "r_cdev"), "--dry-run"]


@case("hang", "a PNG whose header claims 100,000 x 100,000 pixels: `compress predict`", "too large", 2,
      "tests/test_bad_inputs.py")
def png_bomb(w):
    import struct
    import zlib

    from PIL import Image

    path = os.path.join(w, "bomb.png")
    Image.new("L", (1, 1)).save(path)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    chunk = b"IHDR" + struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0)
    data[8:33] = struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
    with open(path, "wb") as f:
        f.write(bytes(data))
    return ["predict", os.path.join(w, "base"), path]


@case("unsafe", "a link in place of <run>/export (to a folder elsewhere): the export stage rerun", "symbolic link", 2,
      "tests/test_bad_inputs.py")
def export_link(w):
    run_dir = copy_run(w, "r_exlink")
    shutil.move(os.path.join(run_dir, "export"), os.path.join(w, "export_elsewhere"))
    os.symlink(os.path.join(w, "export_elsewhere"), os.path.join(run_dir, "export"))
    return ["run", "--run-dir", run_dir, "--stages", "export", "--force"]


@case("unsafe", "an ONNX file whose weights are external data at `/etc/passwd`: `compress predict`", "separate file",
      2, "tests/test_bad_inputs.py")
def onnx_external(w):
    import onnx

    model = onnx.load(os.path.join(w, "base", "export", "model.fp32.onnx"))
    tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "/etc/passwd"
    path = os.path.join(w, "external.onnx")
    onnx.save(model, path)
    return ["predict", path, os.path.join(w, "digit.png")]


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling would create the marker file


@case("unsafe", "a pickle whose loading runs code as model.teacher_weights", "weights_only", 2,
      "tests/test_bad_inputs.py")
def pickle_code(w):
    import torch

    path = os.path.join(w, "teacher.pth")  # torch.save pickles the object and its __reduce__ as is
    torch.save({"conv.weight": _RunsCode(os.path.join(w, "pickle_ran_code"))}, path)
    return ["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", os.path.join(w, "r_pickle"), "--stages",
            "teacher", "--set", f"model.teacher_weights={path}"]


@case("one sentence", "a damaged file in torch's weights cache (`model.teacher_weights=pretrained`)", "sha256", 2,
      "tests/models/test_weights.py")
def damaged_cache(w):
    home = os.path.join(w, "torch_home")
    os.makedirs(os.path.join(home, "hub", "checkpoints"))
    with open(os.path.join(home, "hub", "checkpoints", "resnet18-f37072fd.pth"), "wb") as f:
        f.write(b"half of a download")
    return (["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", os.path.join(w, "r_cache"), "--stages",
             "teacher", "--set", "model.teacher=torchvision:resnet18", "--set", "model.teacher_weights=pretrained"],
            {"TORCH_HOME": home, "COMPRESS_OFFLINE": "1"})


@case("hang", "a temporary folder (TMPDIR) 76 characters long with `train.num_workers=2`", "characters long", 2,
      "tests/test_cpus.py")
def long_tmpdir(w):
    folder = os.path.join(w, "t" * max(1, 76 - len(w) - 1))  # 76 characters: one past what worker sockets allow
    os.makedirs(folder)
    return (["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", os.path.join(w, "r_tmpdir"), "--stages", "teacher",
             "--set", "train.num_workers=2"], {"TMPDIR": folder})


@case("unsafe", "a run directory's config.yaml a link to a file of secrets: `compress run --dry-run`", "symbolic link",
      2, "tests/cli/test_pipeline_cmds.py")
def config_link(w):
    run_dir = copy_run(w, "r_config_link")
    with open(os.path.join(w, "secret.txt"), "w") as f:
        f.write("hunter2: yes\n")
    os.remove(os.path.join(run_dir, "config.yaml"))
    os.symlink(os.path.join(w, "secret.txt"), os.path.join(run_dir, "config.yaml"))
    return ["run", "--run-dir", run_dir, "--dry-run"]


@case("unsafe", "`--name ../../escape` (a run name leaving artifacts/)", "not a run name", 2,
      "tests/cli/test_pipeline_cmds.py")
def name_escape(w):
    return ["run", "--name", "../../escape", "--dry-run"]


@case("unsafe", "a class name with a line break in the ONNX metadata: `compress eval`", "b\\nc", 2,
      "tests/deploy/test_evaluate.py")
def class_name_newline(w):
    path = int8_with_metadata(w, "newline", "class_names", json.dumps(["b\nc"] + [str(i) for i in range(1, 10)]))
    os.makedirs(os.path.join(w, "eval_x", "x"))
    shutil.copy(os.path.join(w, "digit.png"), os.path.join(w, "eval_x", "x", "a.png"))
    return ["eval", path, os.path.join(w, "eval_x")]


def _base_weights(w, name, change):
    """The base run's teacher weights, changed by `change(state)`, saved as `name`."""
    import torch
    from safetensors.torch import load_file

    state = load_file(os.path.join(w, "base", "teacher", "model.safetensors"))
    path = os.path.join(w, name)
    torch.save(change(state), path)
    return path


def _weights_run(w, path, run_name, *extra):
    return ["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", os.path.join(w, run_name), "--stages", "teacher",
            "--set", f"model.teacher_weights={path}", *extra]


@case("wrong result", "float64 weights holding 1e300 (inf as float32) as model.teacher_weights", "infinite", 2,
      "tests/models/test_weights.py")
def weights_overflow(w):
    def change(state):
        state = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
        bias = next(k for k in state if k.endswith("bias") and "classifier" in k or k == "fc.bias")
        state[bias][0] = 1e300
        return state
    return _weights_run(w, _base_weights(w, "f64.pth", change), "r_f64", "--set", "teacher.epochs=0")


@case("wrong result", "weights whose classifier bias alone has another shape, with `teacher.epochs=0`", "epochs", 2,
      "tests/models/test_weights.py")
def weights_bias_alone(w):
    import torch

    def change(state):
        bias = next(k for k in state if k.endswith("bias") and "classifier" in k or k == "fc.bias")
        state[bias] = torch.zeros(3)
        return state
    return _weights_run(w, _base_weights(w, "bias.pth", change), "r_bias", "--set", "teacher.epochs=0")


@case("one sentence", "sparse tensors in a .pth as model.teacher_weights", "sparse_coo", 2,
      "tests/models/test_weights.py")
def weights_sparse(w):
    return _weights_run(w, _base_weights(w, "sparse.pth", lambda s: {k: v.to_sparse() if v.dim() == 2 else v
                                                                       for k, v in s.items()}), "r_sparse")


@case("wrong result", "`--set seed=010` (YAML 1.1 reads 8)", "another base", 2, "tests/run/test_config.py")
def octal(w):
    return ["config", "--set", "seed=010"]


@case("wrong result", "`--set 'data.root=/photos #2'` (YAML reads a comment)", "root: '/photos #2'", 0,
      "tests/run/test_config.py")
def set_comment(w):
    return ["config", "--set", "data.name=imagefolder", "--set", "data.root=/photos #2"]


@case("one sentence", "a LAB-mode TIFF: `compress predict`", "cannot read image", 2, "tests/deploy/test_imageio.py")
def lab_tiff(w):
    from PIL import Image

    Image.new("LAB", (28, 28)).save(os.path.join(w, "lab.tif"))
    return ["predict", os.path.join(w, "base"), os.path.join(w, "lab.tif"), os.path.join(w, "digit.png")]


@case("one sentence", "a manifest accuracy of 10^400: `compress show`", "damaged", 0, "tests/run/test_report.py")
def huge_metric(w):
    run_dir = copy_run(w, "r_huge")

    def change(m):
        m["stages"]["teacher"]["metrics"]["val_acc"] = 10**400
        return m
    edit_json(os.path.join(run_dir, "manifest.json"), change)
    return ["show", run_dir]


@case("message", "another program's folder (its own manifest.json and config.yaml) as --run-dir", "another program",
      2, "tests/run/test_rundir.py")
def foreign_manifest(w):
    folder = os.path.join(w, "webapp")
    os.makedirs(folder)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        f.write('{"name": "app"}')
    with open(os.path.join(folder, "config.yaml"), "w") as f:
        f.write("server: {port: 80}\n")
    return ["run", "--run-dir", folder]


@case("message", "a class folder of .gif files", "skipped (.gif)", 2, "tests/data/test_imagefolder.py")
def gif_class(w):
    from PIL import Image

    root = photos_tree(os.path.join(w, "photos_gif"))
    os.makedirs(os.path.join(root, "train", "bird"))
    for i in range(3):
        Image.new("RGB", (40, 40)).save(os.path.join(root, "train", "bird", f"{i}.gif"))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_gif"), "--set", f"data.root={root}", "--dry-run"]


@case("message", "an ONNX std of 1e-300: `compress predict`", "compress.std", 2, "tests/deploy/test_onnx_model.py")
def tiny_std(w):
    return ["predict", int8_with_metadata(w, "tinystd", "std", json.dumps([1e-300])), os.path.join(w, "digit.png")]


@case("lost", "`qat.float_layers` naming every layer (an int8 file without an int8 layer)", "keeps every layer", 2,
      "tests/test_bad_inputs.py")
def all_float(w):
    return ["run", "--run-dir", copy_run(w, "r_allfloat"), "--stages", "qat", "--set",
            "qat.float_layers=[stem, block1, block2, classifier]"]


# -- found by reading the data, run and deploy paths as a user would (one case per defect fixed) -------------------

@case("wrong result", "Kaggle's Training/ and Testing/ split folders (were two classes)", "Training/ and Testing/", 0,
      "tests/data/test_imagefolder.py")
def kaggle_splits(w):
    root = os.path.join(w, "photos_kaggle")
    photos_tree(root)
    os.rename(os.path.join(root, "train"), os.path.join(root, "Training"))
    os.rename(os.path.join(root, "val"), os.path.join(root, "Testing"))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_kaggle"), "--set", f"data.root={root}", "--dry-run"]


@case("wrong result", "images directly in train/, beside the class folders (were dropped silently)",
      "in no class folder", 0, "tests/data/test_imagefolder.py")
def loose_images(w):
    root = photos_tree(os.path.join(w, "photos_loose"))
    shutil.copy(os.path.join(root, "train", "cat", "0.jpg"), os.path.join(root, "train", "loose.jpg"))
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_loose"), "--set", f"data.root={root}", "--dry-run"]


@case("one sentence", "a 108-megapixel phone photo (12000 x 9000): `compress predict` (was refused as a bomb)",
      "phone108.jpg:", 0, "tests/deploy/test_imageio.py")
def phone_photo(w):
    from PIL import Image

    path = os.path.join(w, "phone108.jpg")
    Image.new("RGB", (12000, 9000), (90, 120, 150)).save(path, quality=80)
    return ["predict", os.path.join(w, "base"), path]


@case("wrong result", "a quoted recursive glob `'imgs/**'`: `compress predict` (folders were unreadable images)",
      "b.png:", 0, "tests/deploy/test_evaluate.py")
def recursive_glob(w):
    os.makedirs(os.path.join(w, "imgs", "sub"))
    shutil.copy(os.path.join(w, "digit.png"), os.path.join(w, "imgs", "a.png"))
    shutil.copy(os.path.join(w, "digit.png"), os.path.join(w, "imgs", "sub", "b.png"))
    with open(os.path.join(w, "imgs", "readme.txt"), "w") as f:
        f.write("x")
    return ["predict", os.path.join(w, "base"), os.path.join(w, "imgs", "**")]


@case("one sentence", "a file where the run's pixel cache folder goes", "is a file where compress keeps", 2,
      "tests/data/test_pixels.py")
def file_for_cache(w):
    root = photos_tree(os.path.join(w, "photos_cachefile"))
    args = [*PHOTOS, "--run-dir", os.path.join(w, "r_cachefile"), "--set", f"data.root={root}", "--stages", "teacher"]
    run(["run", *args], timeout=300)
    pixels = os.path.join(w, "r_cachefile", "cache", "pixels")
    folder = os.path.join(pixels, next(n for n in sorted(os.listdir(pixels)) if n.startswith("train-")))
    shutil.rmtree(folder)
    with open(folder, "w") as f:
        f.write("x")
    return ["run", *args, "--force"]


@case("lost", "`--stages qat --set data.unlabeled=...`: the next plain run (was: distill, qat, export to redo)",
      "distill  skip", 0, "tests/run/test_pipeline.py")
def unread_set_saved(w):
    run_dir = copy_run(w, "r_unread_set")
    extra = photos_tree(os.path.join(w, "extra_unread"), classes=("x",), train=4, val=0)
    run(["run", "--run-dir", run_dir, "--stages", "qat", "--force", "--set",
         f"data.unlabeled={os.path.join(extra, 'train', 'x')}"], timeout=300)
    return ["run", "--run-dir", run_dir, "--dry-run"]


@case("message", "`--device cuda --dry-run` where torch sees no CUDA device (was a plan, exit 0)", "no CUDA device",
      2, "tests/run/test_preflight.py")
def dry_run_cuda(w):
    return ["run", "--run-dir", os.path.join(w, "r_cuda"), "--device", "cuda", "--dry-run"]


@case("lost", "`export.ptq=false` after an export that wrote model.ptq.onnx (was left beside, another model's)",
      "removed export/model.ptq.onnx", 0, "tests/stages/test_export.py")
def stale_ptq(w):
    return ["run", "--run-dir", copy_run(w, "r_noptq"), "--stages", "export", "--set", "export.ptq=false"]


@case("wrong result", "`RANK=1` left in the shell without WORLD_SIZE: `compress run --dry-run` (was rank 1 of 1: "
      "'unexpected TypeError', config errors unsaid)", "teacher  run", 0, "tests/cli/test_base.py")
def stray_rank(w):
    return ["run", "--run-dir", os.path.join(w, "r_stray_rank"), "--dry-run"], {"RANK": "1"}


@case("message", "`RANK=3 WORLD_SIZE=2` in the shell: `compress run` (rank 3 of 2 waited for peers)",
      "RANK=3 is not one of WORLD_SIZE=2's ranks", 2, "tests/cli/test_base.py")
def rank_outside_world(w):
    return _teacher_with_rank(w, "r_rank3", "3", "29771")


def _teacher_with_rank(w, name, rank, port):
    """The teacher stage started as rank `rank` of a WORLD_SIZE 2 whose peer never comes."""
    return (["run", "--run-dir", os.path.join(w, name), "--stages", "teacher"],
            {"RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})


@case("lost", "a truncated photo in `data.unlabeled` (header intact): the full run (was found after the teacher "
      "trained)", "truncated", 2, "tests/stages/test_distill.py")
def truncated_unlabelled(w):
    root = photos_tree(os.path.join(w, "photos_trunc_unl"))
    extra = photos_tree(os.path.join(w, "extra_trunc"), classes=("x",), train=4, val=0, shade=2)
    victim = os.path.join(extra, "train", "x", "0.jpg")
    with open(victim, "rb") as f:
        data = f.read()
    with open(victim, "wb") as f:
        f.write(data[:-60])  # the header intact: only decoding finds it
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_trunc_unl"), "--set", f"data.root={root}", "--set",
            f"data.unlabeled={os.path.join(extra, 'train', 'x')}"]


@case("one sentence", "an empty (0-byte) photo among the labelled ones: `--dry-run` (was a plan, exit 0; the run "
      "then stopped at it)", "are empty (0 bytes)", 2, "tests/data/test_imagefolder.py")
def empty_photo(w):
    root = photos_tree(os.path.join(w, "photos_empty"))
    open(os.path.join(root, "val", "dog", "empty.jpg"), "wb").close()
    return ["run", *PHOTOS, "--run-dir", os.path.join(w, "r_empty"), "--set", f"data.root={root}", "--dry-run"]


@case("lost", "other classes in data.root, `--stages qat,export` (was refused one stage back per attempt)",
      "the stages from teacher on must run again", 2, "tests/run/test_state.py")
def other_classes(w):
    first = photos_tree(os.path.join(w, "photos_classes_a"))
    second = photos_tree(os.path.join(w, "photos_classes_b"), classes=("ant", "bee"))
    run_dir = os.path.join(w, "r_classes")
    run(["run", *PHOTOS, "--run-dir", run_dir, "--set", f"data.root={first}"], timeout=300)
    return ["run", *PHOTOS, "--run-dir", run_dir, "--set", f"data.root={second}", "--stages", "qat,export"]


@case("hang", "a quoted recursive glob through two self-links (`'gloop/**'`): `compress predict` (ran forever)",
      "a.png", 0, "tests/deploy/test_evaluate.py")
def glob_through_self_links(w):
    from PIL import Image

    folder = os.path.join(w, "gloop")
    os.makedirs(folder)
    Image.new("L", (8, 8), 90).save(os.path.join(folder, "a.png"))
    os.symlink(".", os.path.join(folder, "l1"))
    os.symlink(".", os.path.join(folder, "l2"))
    return ["predict", os.path.join(w, "base"), os.path.join(folder, "**")]


def _onnx_with_tail(w, name, nodes, output, weights=()):
    import onnx

    proto = onnx.load(os.path.join(w, "base", "export", "model.fp32.onnx"))
    final = proto.graph.output[0].name
    for node in nodes:
        node.input[:] = [final if i == "logits" else i for i in node.input]
    proto.graph.node.extend(nodes)
    proto.graph.initializer.extend(weights)
    del proto.graph.output[:]
    proto.graph.output.append(output)
    path = os.path.join(w, f"{name}.onnx")
    onnx.save(proto, path)
    return path


@case("hang", "an ONNX file whose Loop runs 10^15 times: `compress predict` (ran until killed; Ctrl-C did not stop "
      "it)", "holds control flow (Loop)", 2, "tests/deploy/test_hostile_onnx.py")
def onnx_loop(w):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Identity", ["x_in"], ["x_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("x_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, None)])
    path = _onnx_with_tail(w, "loop", [helper.make_node("Loop", ["many", "yes", "logits"], ["looped"], body=body)],
                           helper.make_tensor_value_info("looped", TensorProto.FLOAT, ["N", 10]),
                           [numpy_helper.from_array(np.array(10**15, np.int64), "many"),
                            numpy_helper.from_array(np.array(True), "yes")])
    return ["predict", path, os.path.join(w, "digit.png")]


@case("one sentence", "an ONNX file whose output is one number an image (argmax): `compress eval` (unexpected "
      "AxisError)", "not the float class scores", 2, "tests/deploy/test_hostile_onnx.py")
def onnx_rank1(w):
    from onnx import TensorProto, helper

    path = _onnx_with_tail(w, "argmax", [helper.make_node("ArgMax", ["logits"], ["pick"], axis=1, keepdims=0)],
                           helper.make_tensor_value_info("pick", TensorProto.INT64, ["N"]))
    tree = os.path.join(w, "eval_rank1", "0")
    os.makedirs(tree)
    shutil.copy(os.path.join(w, "digit.png"), tree)
    return ["eval", path, os.path.dirname(tree)]


@case("one sentence", "`RANK=abc WORLD_SIZE=2` in the shell: `compress run` (unexpected ValueError)",
      "RANK='abc' is not a whole number", 2, "tests/cli/test_base.py")
def rank_not_a_number(w):
    return _teacher_with_rank(w, "r_rank_abc", "abc", "29772")


@case("one sentence", "a resume checkpoint nested 100,000 brackets deep: `compress show` (unexpected "
      "RecursionError)", "damaged", 0, "tests/training/test_checkpoint.py")
def deep_checkpoint_state(w):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    run_dir = copy_run(w, "r_deep_state")
    path = os.path.join(run_dir, "teacher", "model.safetensors")
    with safe_open(path, "pt") as f:
        meta = dict(f.metadata())
    meta["state"] = "[" * 100_000 + "]" * 100_000
    last = os.path.join(run_dir, "teacher", "last")
    os.makedirs(last, exist_ok=True)
    save_file(load_file(path), os.path.join(last, "checkpoint.safetensors"), metadata=meta)
    edit_json(os.path.join(run_dir, "manifest.json"), lambda d: {**d, "stages": {**d["stages"], "teacher": {
        **d["stages"]["teacher"], "status": "interrupted"}}})
    return ["show", run_dir]


def _forged_metadata(w, name, rel, key, value):
    """A copy of the base run whose `rel` weights file has metadata `key` set to `value`, its sha256 updated in
    manifest.json so that it reads as the stage's own output."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from compress.fileio import sha256_file

    run_dir = copy_run(w, name)
    path = os.path.join(run_dir, rel)
    with safe_open(path, "pt") as f:
        meta = dict(f.metadata())
    save_file(load_file(path), path, metadata={**meta, key: value})
    stage = rel.split("/")[0]
    edit_json(os.path.join(run_dir, "manifest.json"), lambda d: {**d, "stages": {**d["stages"], stage: {
        **d["stages"][stage], "outputs": {**d["stages"][stage]["outputs"], rel: sha256_file(path)}}}})
    return run_dir


@case("one sentence", "qat.safetensors' qconfig metadata edited (`{{{`), its manifest hash updated: the export stage "
      "(unexpected TypeError)", "metadata 'qconfig'", 2, "tests/stages/test_export.py")
def forged_qconfig(w):
    return ["run", "--run-dir", _forged_metadata(w, "r_forged_qconfig", "qat/qat.safetensors", "qconfig", "{{{"),
            "--stages", "export"]


@case("one sentence", "distill/model.safetensors' class_names `[1, 2]`, its manifest hash updated: the export stage "
      "(unexpected TypeError)", "was trained on 2 classes (1, 2)", 2, "tests/run/test_context.py")
def forged_class_names(w):
    return ["run", "--run-dir", _forged_metadata(w, "r_forged_classes", "distill/model.safetensors", "class_names",
                                                 "[1, 2]"), "--stages", "export"]


@case("one sentence", "an ONNX compress.std of `[\"a\"]`: `compress bench` (unexpected TypeError)", "ms", 0,
      "tests/deploy/test_hostile_onnx.py")
def onnx_std_strings(w):
    return ["bench", int8_with_metadata(w, "std_strings", "std", '["a"]'), "--threads", "1", "--repeats", "2"]


@case("hang", "the same Loop file: `compress bench` (ran until killed; Ctrl-C did not stop it)",
      "holds control flow (Loop)", 2, "tests/deploy/test_hostile_onnx.py")
def onnx_loop_bench(w):
    onnx_loop(w)  # writes the same file again
    return ["bench", os.path.join(w, "loop.onnx"), "--threads", "1", "--repeats", "2"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/hostile", help="scratch folder (emptied first)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    w = os.path.abspath(args.work)
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    with open(os.path.join(w, "tiny.yaml"), "w") as f:
        f.write(TINY)
    from PIL import Image

    Image.new("L", (8, 8), 128).save(os.path.join(w, "digit.png"))
    code, seconds, out = run(["run", "-c", os.path.join(w, "tiny.yaml"), "--run-dir", os.path.join(w, "base")],
                             timeout=600)
    if code != 0:
        raise SystemExit(f"the base run failed ({code}):\n{out[-2000:]}")
    rows = []
    for group, name, expect, want_rc, test, build in CASES:
        built = build(w)  # the arguments, or (arguments, environment)
        argv, env = built if isinstance(built, tuple) else (built, {})
        code, seconds, out = run(argv, env=env)
        lines = [line for line in out.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        raw = any(ch in out for ch in ("\x1b", "\x07"))
        said = out.lower().count(expect.lower())
        ok = (code != "hang" and (code == want_rc) and "Traceback" not in out and not raw and said
              and (said == 1 or not name.endswith("(said once, not retried)")))
        shown = next((line for line in lines if expect.lower() in line.lower()), last)
        shell_env = "".join(f"{k}={v} " for k, v in env.items())
        rows.append({"group": group, "case": name, "command": shell_env + "compress " + " ".join(map(str, argv)),
                     "exit": code, "seconds": round(seconds, 1), "says": shown, "raw_control_chars": raw,
                     "traceback": "Traceback" in out, "ok": ok, "test": test})
    print("| class | case | exit | s | what it says now | ok | test |")
    print("|---|---|---:|---:|---|---|---|")
    for r in rows:
        says = r["says"].replace("|", "\\|")[:220]
        print(f"| {r['group']} | {r['case']} | {r['exit']} | {r['seconds']} | {says} | "
              f"{'yes' if r['ok'] else '**no**'} | `{r['test']}` |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
