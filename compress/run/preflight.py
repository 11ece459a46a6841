"""Everything about a run that can be checked before a single file is written, in one explicit step.

`compress.config` checks what the YAML says on its own (types, ranges, finite numbers). This module checks it
against the world: the dataset folder exists, the model names resolve, weight files are there and fit their
models, and every training stage's global batch splits evenly over the processes of this launch. Every problem
is reported at once, with its key, like a config error.
"""

import os

from compress.errors import ConfigError

TRAINING_STAGES = ("teacher", "distill", "qat")


def problems(cfg, stage_names, world_size, run_root=None, download=True):
    """The list of problems (empty when the run can start); `run_root`: the run directory it would write;
    `download`: fetch torchvision weights named by model.*_weights into torch's cache when missing (a dry run
    does not: it only says it would)."""
    found = _device_problems(cfg)
    data = cfg.data
    for key, folder in _image_folders(data, stage_names):
        if run_root and _inside(run_root, folder):
            found.append(f"data.{key}: the run directory '{run_root}' is inside '{folder}', where its files would "
                         "be read as images; pass --run-dir outside it (or start compress from another folder)")
    found.extend(_root_problems(data, run_root))
    found.extend(_normalisation_problems(data))
    from compress.models.registry import source_problem

    for key, name in (("model.teacher", cfg.model.teacher), ("model.student", cfg.model.student)):
        problem = source_problem(name)
        if problem:
            found.append(f"{key}: {problem}")
    if not found:
        found.extend(_model_problems(cfg, stage_names))
    from compress.errors import InputError
    from compress.models.weights import is_weights_name, path_problem, weights_file

    for key, stage in WEIGHTS_READ_BY.items():
        value = getattr(cfg.model, key)
        if stage not in stage_names:  # a skipped stage's weights are neither fetched nor needed
            continue
        if value and is_weights_name(value):
            try:  # found in torch's cache, or downloaded into it where the network allows
                weights_file(value, getattr(cfg.model, key.replace("_weights", "")), f"model.{key}",
                             download=download)
            except InputError as e:
                found.append(str(e))
        elif value and (problem := path_problem(value, f"model.{key}")):
            found.append(problem)
    if cfg.qat.source == "baseline" and not cfg.distill.baseline and {"qat", "export"} & set(stage_names):
        found.append("qat.source: baseline quantizes the student trained alone, which distill.baseline: false does "
                     "not train; set distill.baseline=true, or qat.source=distill")
    if run_root and data.name == "imagefolder" and not found:
        found.extend(_class_problems(data, stage_names, run_root))
    if "distill" in stage_names and data.unlabeled:
        from compress.data.imagefolder import unlabeled_problem

        problem = unlabeled_problem(data)
        if problem:
            found.append(problem)
    if "export" in stage_names:
        from compress.deploy.runtimes import missing

        for runtime in cfg.export.runtimes or ():
            if missing(runtime):
                found.append(f"export.runtimes: {missing(runtime)}, or leave {runtime} out of export.runtimes")
    found.extend(_worker_problems(cfg, stage_names))
    found.extend(_batch_problems(cfg, stage_names, world_size))
    return found


def _normalisation_problems(data):
    """data.mean/std of another length than the images' channels (known without reading an image), said before
    any image is decoded rather than after."""
    from compress.data.registry import input_shape_of

    channels = input_shape_of(data)[0]
    if data.mean is None or len(data.mean) == channels:  # the config's own checks: std is given alike
        return []
    return [f"data.mean/std have {len(data.mean)} values but the images have {channels} channel(s); give one value "
            "per channel, or null to compute them from the training images"]


def _worker_problems(cfg, stage_names):
    """DataLoader workers the config asks for that could not run here (their sockets' folder path too long)."""
    from compress.cpus import socket_folder_problem

    if not (cfg.train.num_workers and set(stage_names) & set(TRAINING_STAGES)):
        return []
    problem = socket_folder_problem()
    return [f"train.num_workers: DataLoader worker processes cannot run here: {problem} (or set "
            "train.num_workers=0)"] if problem else []


def _root_problems(data, run_root):
    """data.root that is not a folder: a file (an archive to unpack), or nothing there."""
    if not data.root or data.download or os.path.isdir(os.path.expanduser(data.root)):
        return []
    if os.path.exists(os.path.expanduser(data.root)):
        archive = data.root.lower().endswith((".zip", ".tar", ".tgz", ".gz", ".7z", ".rar"))
        return [f"data.root: '{data.root}' is a file, not a folder; "
                f"{'unpack it and ' if archive else ''}point data.root at the folder that holds the images"]
    return [f"data.root: folder '{data.root}' does not exist; point data.root at the dataset"
            + _root_of_the_run(run_root, data.root)]


def _root_of_the_run(run_root, asked):
    """For a data.root that does not exist: the words naming the one the run directory's config.yaml holds, when that
    folder exists (`-c photos --run-dir RUN` gives the recipe's placeholder root, not the run's), or ''."""
    from compress.errors import CompressError
    from compress.run.config import read_yaml

    path = os.path.join(run_root, "config.yaml") if run_root else ""
    try:
        saved = read_yaml(path, follow_links=False) if path and os.path.isfile(path) else {}
    except CompressError:
        return ""
    root = saved.get("data", {}).get("root") if isinstance(saved.get("data"), dict) else None
    if not isinstance(root, str) or root == asked or not os.path.isdir(os.path.expanduser(root)):
        return ""
    return (f" (the run directory's config.yaml has data.root: {root}; without -c the run uses its own config, or "
            f"--set data.root={root} keeps it)")


def check(cfg, stage_names, world_size, source=None, run_root=None, download=True):
    """Raise one ConfigError listing every problem found by `problems`; then look at the data (its layout,
    without decoding an image) and return its summary: {"lines": [...], "notes": [...], "weights": [notes on
    weights a run would download first]}."""
    found = problems(cfg, stage_names, world_size, run_root, download)
    if found:
        raise ConfigError(found, source=source)
    from compress.data.datasets import describe

    summary = describe(cfg.data, unlabeled="distill" in stage_names)
    return {**summary, "weights": _not_fetched(cfg, stage_names, source)}


def _device_problems(cfg):
    """--device cuda where torch sees none: refused by the dry run as by the run (`distributed.pick_device`)."""
    import torch

    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        from compress.training.distributed import NO_CUDA

        return [NO_CUDA]
    return []


WEIGHTS_READ_BY = {"teacher_weights": "teacher", "student_weights": "distill"}  # model.* key -> its stage


def _not_fetched(cfg, stage_names, source=None):
    """A note per torchvision weights name whose file is not in torch's cache (a dry run does not download); with
    COMPRESS_OFFLINE set the run would refuse instead, and so does the dry run, in the run's words."""
    from compress.errors import InputError
    from compress.models.weights import is_weights_name, offline, weights_file, weights_of

    notes = []
    for key, stage in WEIGHTS_READ_BY.items():
        value, role = getattr(cfg.model, key), key.removesuffix("_weights")
        if stage not in stage_names or not (value and is_weights_name(value)):
            continue
        if os.path.isfile(path := weights_of(cfg.model, role)):
            continue
        if offline():
            try:
                weights_file(value, getattr(cfg.model, role), f"model.{key}", download=True)  # offline: only refuses
            except InputError as e:
                raise ConfigError([str(e)], source=source) from None
        notes.append(f"model.{key}: {value} is not in torch's cache yet; `compress run` downloads it to {path} "
                     "first (where the network allows)")
    return notes


def _model_problems(cfg, stage_names):
    """Build the models the requested stages need (a user function that returns no nn.Module is caught here),
    and when QAT will run, prepare its model for QAT: a model torch.fx cannot trace fails now, naming the
    construct, not after hours of teacher training."""
    from compress.data.datasets import num_classes_of
    from compress.data.registry import input_shape_of
    from compress.errors import InputError
    from compress.models.registry import build_model
    from compress.run.config import QAT_SOURCES

    shape, classes = input_shape_of(cfg.data), num_classes_of(cfg.data)
    roles = {"model.teacher": cfg.model.teacher} if "teacher" in stage_names else {}
    if {"distill", "qat", "export"} & set(stage_names):
        roles["model.student"] = cfg.model.student
    found, built = [], {}
    for key, name in roles.items():
        try:
            model = build_model(name, shape, classes)
        except InputError as e:
            found.append(str(e) if str(e).startswith("model") else f"{key}: {e}")
            continue
        problem = _output_problem(model, shape, classes)
        if problem:
            found.append(f"{key}: {name} {problem}")
        else:
            built[key] = model
    found.extend(_weights_problems(cfg, stage_names, built))
    found.extend(_feature_problems(cfg, stage_names, built, shape))
    quantized = QAT_SOURCES[cfg.qat.source].model_key
    if "qat" in stage_names and quantized in built:
        found.extend(_float_layer_problems(cfg.qat.float_layers, built[quantized], cfg.model, quantized))
        import torch

        from compress.quant import fx

        try:
            fx.prepare(built[quantized], torch.zeros(2, *shape), cfg.qat.backend, cfg.qat.activation_range,
                          cfg.qat.per_channel)
        except InputError as e:
            found.append(f"{quantized}: {e}; QAT and export need a model torch.fx can trace: take the data-dependent "
                         "branch out of forward (or torch.fx.wrap the function that holds it), or choose another "
                         "model (--stages teacher,distill trains it in float without them)")
    return found


def _batch_problems(cfg, stage_names, world_size):
    """A training stage's global batch that does not split evenly over the processes."""
    from compress.run.config import MAX_BATCH

    found = []
    for stage in stage_names:
        if stage in TRAINING_STAGES and not (stage == "teacher" and cfg.teacher.epochs == 0):
            batch = getattr(cfg, stage).batch_size
            if batch % world_size:
                fix = (f"use a multiple of {world_size}" if world_size <= MAX_BATCH else
                       f"a batch holds at most {MAX_BATCH:,} images, so run at most {MAX_BATCH:,} processes")
                found.append(f"{stage}.batch_size: {batch} does not split evenly over {world_size:,} processes; {fix}")
    return found


def _float_layer_problems(float_layers, model, model_cfg, key):
    """qat.float_layers naming a layer the quantized model has not (the report and the ONNX metadata would list
    it as float while it is int8), or covering every layer (the int8 file would hold no int8 layer)."""
    from compress.models.features import layer_list
    from compress.quant.mixed_precision import covered, quantizable_layers

    names = dict(model.named_modules())
    found = [f"qat.float_layers: {getattr(model_cfg, key.split('.')[1])} ({key}) has no layer '{name}'; available "
             f"layers: {layer_list(model)}" for name in float_layers or () if not name or name not in names]
    layers = quantizable_layers(model)
    if float_layers and not found and len(covered(float_layers, layers)) == len(layers):
        found.append(f"qat.float_layers: {list(float_layers)} keeps every layer of {key} float "
                     f"({', '.join(layers)}), so the int8 file would hold no int8 layer; leave at least one out "
                     "(--set 'qat.float_layers=[]' quantizes them all)")
    return found


def _output_problem(model, shape, classes):
    """Why `model` cannot be trained here, or '': one forward pass of a batch of 2 zero images in training and in
    eval mode must give one tensor of class scores, (2, classes). A user's model that returns a tuple, ignores
    num_classes, wants other channels or one image size fails now, in one sentence, not mid-stage with a bare
    torch error (after the teacher's hours, for the student)."""
    import torch

    c, h, w = shape
    param = next(model.parameters(), None)  # a user's function may hand back a model already on a GPU, or in fp16
    device = param.device if param is not None else "cpu"
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    for mode in ("training", "eval"):
        model.train(mode == "training")
        try:
            with torch.no_grad():
                out = model(torch.zeros(2, *shape, device=device, dtype=dtype))
        except Exception as e:  # any error of the user's code: named, with the input it was given
            first = (str(e).strip().splitlines() or [""])[0][:160]
            sizes = any(word in first for word in ("size", "shape", "channels", "Expected", "expected"))
            return (f"fails on a batch of 2 images of {c}x{h}x{w} in {mode} mode ({type(e).__name__}: {first})"
                    + ("; check data.image_size and data.channels against what the model expects" if sizes else ""))
        if not torch.is_tensor(out):
            return (f"returns a {type(out).__name__} for a batch of 2 images of {c}x{h}x{w} in {mode} mode; compress "
                    f"needs one tensor of class scores, of shape (2, {classes})")
        if tuple(out.shape) != (2, classes):
            return (f"returns a tensor of shape {tuple(out.shape)} for a batch of 2 images of {c}x{h}x{w} in {mode} "
                    f"mode; compress needs class scores of shape (2, {classes}), for the data's {classes} classes "
                    "(a model function is given num_classes when it names it)")
    model.train()
    return ""


def _class_problems(data, stage_names, run_root):
    """A model of a stage this run leaves out, trained on other classes than data.root now holds: the stages from
    the earliest such one must run again, named with the command - in the dry run too, and at once, not one stage
    back per attempt as each stage refuses its input."""
    from compress.data.imagefolder import scan
    from compress.errors import CompressError
    from compress.run.context import classes_text
    from compress.run.rundir import RunDir
    from compress.training.checkpoint import read_metadata
    from stages import ORDER

    run = RunDir(run_root)
    try:
        stages = run.manifest()["stages"] if run.exists() else {}
        classes = list(scan(data)["classes"])
    except CompressError:  # said by the checks that read them
        return []
    first = min(ORDER.index(name) for name in stage_names)
    for name in ORDER[:first]:
        for rel in (stages.get(name) or {}).get("outputs") or {}:
            if not rel.endswith(".safetensors") or not os.path.isfile(run.path(rel)):
                continue
            try:
                trained_on = read_metadata(run.path(rel)).get("class_names")
            except CompressError:
                continue
            if isinstance(trained_on, list) and trained_on != classes:
                return [f"{rel} was trained on {classes_text(trained_on)}, but data.root now holds "
                        f"{classes_text(classes)}: the stages from {name} on must run again on these images - compress "
                        f"run --run-dir {run_root} --stages {','.join(ORDER[ORDER.index(name):])} (or --name NEW for a "
                        "separate run that keeps this one)"]
    return []


def _feature_problems(cfg, stage_names, built, input_shape):
    """The feature losses' layers (the cosine loss's, the hint's): a name the student has not, or - when this run
    trains the teacher first - a teacher layer it has not or feature shapes no adapter can match, fails now, not
    when distill starts after the teacher's hours. One forward pass of zeros through the throwaway models. A run
    that starts at distill builds model.teacher's architecture for it: its layer names and shapes do not depend on
    the weights, so the dry run and the run decide alike."""
    from compress.distill.feature_losses import FEATURE_LOSSES

    d = cfg.distill
    if "distill" not in stage_names or not any(getattr(d, name).weight for name in FEATURE_LOSSES) \
            or "model.student" not in built:
        return []
    import torch

    from compress.distill.teacher import layer_problems, probe_features
    from compress.errors import InputError

    student, teacher = built["model.student"], built.get("model.teacher")
    if "teacher" not in stage_names:  # a run that starts at distill: the names are the architecture's, whatever
        from compress.data.datasets import num_classes_of  # its weights (a teacher this run trains was checked above)
        from compress.models.registry import build_model

        try:
            teacher = build_model(cfg.model.teacher, input_shape, num_classes_of(cfg.data))
        except InputError:
            teacher = None  # the distill stage says what is wrong with it, with the checkpoint in hand
        if teacher is not None and _output_problem(teacher, input_shape, num_classes_of(cfg.data)):
            teacher = None  # likewise: its forward pass is the distill stage's to report
    found = layer_problems(d, student, teacher)
    if not found and teacher is not None:
        try:
            probe_features(d, student, teacher, torch.zeros(2, *input_shape))
        except InputError as e:
            found.append(str(e))
        except Exception as e:  # a forward pass that fails on the probe: the models' own checks name it
            found.append(f"distill: probing the feature layers failed ({e.__class__.__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}); check the distill feature losses' "
                         "layers and data.image_size")
    return found


def _weights_problems(cfg, stage_names, built):
    """A weights file that cannot be read, or does not fit its model, fails now - not when the stage that loads it
    starts, after the stages before it have trained (the distill stage reads model.student_weights after the
    teacher's hours). Loads into the throwaway models `built` by _model_problems."""
    from compress.errors import InputError
    from compress.models.weights import load_pretrained, untrained_head_problem, weights_of

    found = []
    for weights_key, stage in WEIGHTS_READ_BY.items():
        key = f"model.{weights_key.removesuffix('_weights')}"
        try:
            path = weights_of(cfg.model, key.split(".")[1])
        except InputError:
            continue  # problems() says why
        if not path or stage not in stage_names or key not in built or not os.path.isfile(os.path.expanduser(path)):
            continue  # not read by this run, or not there (problems() says so)
        try:
            note = load_pretrained(built[key], path, f"{key}_weights", getattr(cfg.model, key.split(".")[1]))
        except InputError as e:
            found.append(str(e))
            continue
        if key == "model.teacher" and cfg.teacher.epochs == 0:
            from compress.data.datasets import num_classes_of

            problem = untrained_head_problem(note, path, num_classes_of(cfg.data))
            found += [problem] if problem else []
    return found


def _image_folders(data, stage_names):
    """[(data key, folder)] whose every file this run reads as an image: data.root's train/ and held-out folders
    (or data.root itself, flat or train/ alone), and data.unlabeled when distill runs."""
    from compress.deploy.folders import split_folders

    found = []
    if data.name == "imagefolder" and data.root:
        root = os.path.expanduser(data.root)
        train, held_out = split_folders(root)
        found += [("root", train), ("root", os.path.join(root, held_out))] if train and held_out else [
            ("root", train or root)]
    if data.unlabeled and "distill" in stage_names:
        found.append(("unlabeled", data.unlabeled))
    return found


def _inside(path, folder):
    """Whether `path` is `folder` or below it (links resolved)."""
    path, folder = os.path.realpath(os.path.expanduser(path)), os.path.realpath(os.path.expanduser(folder))
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
