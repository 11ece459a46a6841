"""The models of distillation: the student with the training-only adapters of its feature losses (the hint's
regressor), and the frozen teacher whose outputs (logits, and each feature loss's side) come from forward hooks on
the unmodified models. Both are wired from the registry, `feature_losses.FEATURE_LOSSES`."""

import torch
from torch import nn

from compress.distill.feature_losses import FEATURE_LOSSES, STORED_FEATURE
from compress.errors import InputError
from compress.models.features import FeatureTap, layer_list


class StudentWithRegressor(nn.Module):
    """The student plus the training-only adapters of its feature losses (the hint's regressor), trained as one
    module inside one DDP wrapper (so the adapters' gradients are synchronised too). Returns the logits and
    {feature loss: the student's side of it}."""

    def __init__(self, student, layers=None, adapters=None):
        super().__init__()
        self.student = student
        self.layers = dict(layers or {})  # feature loss -> student layer
        self.adapters = nn.ModuleDict(adapters or {})  # FeatureLoss.adapter_name or the loss's name -> module
        self._adapter_of = {name: FEATURE_LOSSES[name].adapter_name or name for name in self.layers}
        self.tap = FeatureTap(student, list(self.layers.values()), role="student")

    def forward(self, x):
        logits = self.student(x)
        features = {}
        for name, layer in self.layers.items():
            out = self.tap.outputs[layer]
            adapter = self.adapters[self._adapter_of[name]] if self._adapter_of[name] in self.adapters else None
            features[name] = out if adapter is None else adapted(adapter, out)
        return logits, features


def adapted(adapter, features):
    """A feature loss's adapter applied to the student's features (a linear one to them flattened)."""
    return adapter(features.flatten(1) if isinstance(adapter, nn.Linear) else features)


class FrozenTeacher:
    """The teacher in eval mode, without gradients, never wrapped in DDP. Called on a batch, it returns its
    logits and, for each feature loss it was wired for, its side of that loss (`FeatureLoss.teacher_side` of the
    layer's output, given the student's feature shape)."""

    def __init__(self, teacher, layers=None, student_shapes=None):
        self.model = teacher.eval().requires_grad_(False)
        self.layers = dict(layers or {})  # feature loss -> teacher layer
        self.student_shapes = dict(student_shapes or {})  # feature loss -> the student side's shape
        self.tap = FeatureTap(teacher, list(self.layers.values()), role="teacher")

    @property
    def stored_layer(self):
        """The teacher layer of the feature loss the store keeps ('' when it is off)."""
        return self.layers.get(STORED_FEATURE, "")

    @property
    def stored_width(self):
        """The width of what the store keeps per image for that loss (0 when it is off)."""
        shape = self.student_shapes.get(STORED_FEATURE)
        return int(torch.Size(shape).numel()) if self.stored_layer and shape else 0

    @torch.no_grad()
    def __call__(self, x):
        out = {"logits": self.model(x)}
        for name, layer in self.layers.items():
            out[name] = FEATURE_LOSSES[name].teacher_side(self.tap.outputs[layer], self.student_shapes[name])
        return out


def feature_shapes(student, teacher, student_layers, teacher_layers, example):
    """{("student" | "teacher", layer): feature shape without the batch}, from one forward pass in eval mode."""
    shapes = {}
    for role, model, layers in (("student", student, student_layers), ("teacher", teacher, teacher_layers)):
        if not layers:
            continue
        tap = FeatureTap(model, layers, role=role)
        was_training = model.training
        try:
            with torch.no_grad():
                model.eval()(example)
        finally:
            model.train(was_training)
            tap.remove()
        unused = [layer for layer in layers if layer not in tap.outputs]
        if unused:
            raise InputError(f"the {role}'s layer '{unused[0]}' is never called in its forward pass, so it has no "
                             f"output to learn from; pick a layer it runs (distill.cosine / distill.hint {role}_layer)")
        shapes.update({(role, k): tuple(v.shape[1:]) for k, v in tap.outputs.items()})
    return shapes


def layer_problems(d, student, teacher):
    """Each layer the feature losses of distill config `d` name that its model does not have, as one line naming
    the key (checked before anything is written; `teacher` may be None when it is not needed)."""
    found = []
    for loss in FEATURE_LOSSES:
        if not getattr(d, loss).weight:
            continue
        for role, model in (("teacher", teacher), ("student", student)):
            name = getattr(getattr(d, loss), f"{role}_layer")
            names = [n for n, _ in model.named_modules() if n] if model is not None else []
            if model is not None and (not name or name not in names):
                import difflib

                close = difflib.get_close_matches(name or "", names, n=3)
                hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
                found.append(f"distill.{loss}.{role}_layer: the {role} has no layer '{name}'; {hint}available layers: "
                             f"{layer_list(model)}")
    return found


def wire_features(d, student, teacher, example):
    """(student with its adapters, frozen teacher) for distill config `d`, each feature loss whose weight is not 0
    wired by layer name. The shapes are probed with one forward pass of `example` in eval mode; layers whose shapes
    cannot be matched are an InputError naming the loss's section, before any training."""
    active = [name for name in FEATURE_LOSSES if getattr(d, name).weight]
    s_layers = {name: getattr(d, name).student_layer for name in active}
    t_layers = {name: getattr(d, name).teacher_layer for name in active}
    shapes = feature_shapes(student, teacher, list(s_layers.values()), list(t_layers.values()), example)
    adapters, student_shapes = {}, {}
    for name in active:
        loss, section = FEATURE_LOSSES[name], getattr(d, name)
        s_shape, t_shape = shapes[("student", s_layers[name])], shapes[("teacher", t_layers[name])]
        try:
            adapter = loss.adapter(section, s_shape, t_shape)
            if adapter is not None:
                adapters[loss.adapter_name or name] = adapter
                s_shape = _adapted_shape(adapter, s_shape)
            loss.teacher_side(torch.zeros(1, *t_shape), s_shape)  # e.g. a teacher narrower than the student
        except InputError as e:
            message = str(e)
            raise InputError(message if message.startswith(f"distill.{name}") else f"distill.{name}: {message}") \
                from None
        student_shapes[name] = s_shape
    return (StudentWithRegressor(student, s_layers, adapters), FrozenTeacher(teacher, t_layers, student_shapes))


def probe_features(d, student, teacher, example):
    """Raise what `wire_features` would for these models, and leave them as they were (no hooks kept): the
    preflight's check on throwaway models that later checks trace."""
    wired_student, wired_teacher = wire_features(d, student, teacher, example)
    wired_student.tap.remove()
    wired_teacher.tap.remove()


def _adapted_shape(adapter, shape):
    """The shape (without the batch) of what `adapter` makes of features of `shape`."""
    was_training = adapter.training
    try:
        with torch.no_grad():
            probe = torch.zeros(2, *shape)
            return tuple(adapted(adapter.eval(), probe).shape[1:])
    finally:
        adapter.train(was_training)
