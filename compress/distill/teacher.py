"""The models of distillation: the student with its training-only hint regressor, and the frozen teacher whose
outputs (logits, and the hidden features the cosine and hint losses compare) come from forward hooks on the
unmodified models."""

import torch
from torch import nn

from compress.distill.feature_losses import make_regressor, reduce_width
from compress.errors import InputError
from compress.models.features import FeatureTap, layer_list


class StudentWithRegressor(nn.Module):
    """The student plus its training-only hint regressor, trained as one module inside one DDP wrapper (so
    the regressor's gradients are synchronised too). Returns logits and the features the losses need."""

    def __init__(self, student, cosine_layer=None, hint_layer=None, regressor=None):
        super().__init__()
        self.student = student
        self.regressor = regressor
        self.cosine_layer, self.hint_layer = cosine_layer, hint_layer
        self.tap = FeatureTap(student, [n for n in (cosine_layer, hint_layer) if n], role="student")

    def forward(self, x):
        logits = self.student(x)
        cosine = self.tap.outputs.get(self.cosine_layer) if self.cosine_layer else None
        hint = None
        if self.hint_layer and self.regressor is not None:
            features = self.tap.outputs[self.hint_layer]
            hint = self.regressor(features.flatten(1) if isinstance(self.regressor, nn.Linear) else features)
        return logits, cosine, hint


class FrozenTeacher:
    """The teacher in eval mode, without gradients, never wrapped in DDP. Called on a batch, it returns its
    logits and, when asked for, the cosine layer's output reduced to `cosine_width` and the hint layer's
    feature map."""

    def __init__(self, teacher, cosine_layer=None, hint_layer=None, cosine_width=None):
        self.model = teacher.eval().requires_grad_(False)
        self.cosine_layer, self.hint_layer, self.cosine_width = cosine_layer, hint_layer, cosine_width
        self.tap = FeatureTap(teacher, [n for n in (cosine_layer, hint_layer) if n], role="teacher")

    @torch.no_grad()
    def __call__(self, x):
        out = {"logits": self.model(x)}
        if self.cosine_layer:
            out["cosine"] = reduce_width(self.tap.outputs[self.cosine_layer], self.cosine_width)
        if self.hint_layer:
            out["hint"] = self.tap.outputs[self.hint_layer]
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
    for loss in ("cosine", "hint"):
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
    """The feature losses of distill config `d` wired by layer name: (student cosine layer, student hint layer,
    teacher cosine layer, teacher hint layer, cosine width, hint regressor), None where a loss is off. The
    shapes are probed with one forward pass of `example` in eval mode; layers whose shapes cannot be matched are
    an InputError, before any training."""
    s_cos, t_cos = (d.cosine.student_layer, d.cosine.teacher_layer) if d.cosine.weight else (None, None)
    s_hint, t_hint = (d.hint.student_layer, d.hint.teacher_layer) if d.hint.weight else (None, None)
    shapes = feature_shapes(student, teacher, [n for n in (s_cos, s_hint) if n], [n for n in (t_cos, t_hint) if n],
                            example)
    width, regressor = None, None
    if t_cos:
        width = int(torch.Size(shapes[("student", s_cos)]).numel())
        try:
            reduce_width(torch.zeros(1, *shapes[("teacher", t_cos)]), width)  # a teacher narrower than the student
        except InputError as e:
            raise InputError(f"distill.cosine: {e}") from None
    if t_hint:
        regressor = make_regressor(d.hint.regressor, shapes[("student", s_hint)], shapes[("teacher", t_hint)])
    return s_cos, s_hint, t_cos, t_hint, width, regressor
