"""Hidden features by layer name, with forward hooks on unmodified models (any registry or torchvision model)."""

import torch

from compress.errors import InputError


class FeatureTap:
    """Keeps the latest output of each named submodule of `model` in `self.outputs[name]`."""

    def __init__(self, model, names, role="model"):
        modules = dict(model.named_modules())
        for name in names:
            if name not in modules or not name:
                raise InputError(f"the {role} has no layer '{name}'; available layers: {layer_list(model)}")
        self.outputs, self.role = {}, role
        self._handles = [modules[name].register_forward_hook(self._keeper(name)) for name in dict.fromkeys(names)]

    def _keeper(self, name):
        def hook(module, inputs, output):
            if not torch.is_tensor(output):
                raise InputError(f"the {self.role}'s layer '{name}' returns {type(output).__name__}, not a tensor; "
                                 f"pick another layer (distill.cosine / distill.hint {self.role}_layer)")
            # a copy: the layer after it may change its output in place (ResNet's ReLU(inplace=True) after bn1,
            # a block's `out += identity`), which would hand the loss the later layer's values instead of this one's
            self.outputs[name] = output.clone()
        return hook

    def remove(self):
        for handle in self._handles:
            handle.remove()


def layer_list(model, limit=40):
    """The model's layer names for an error message: all of them, or - when there are more than `limit` - the top
    level first (torchvision's avgpool was past the cut), then the first `limit`."""
    names = [n for n, _ in model.named_modules() if n]
    shown = ", ".join(names[:limit])
    if len(names) <= limit:
        return shown
    top = [n for n in names if "." not in n]
    top_shown = ", ".join(top[:limit]) + (f", ... ({len(top) - limit} more)" if len(top) > limit else "")
    return f"{top_shown} at the top level; all: {shown}, ... ({len(names) - limit} more)"
