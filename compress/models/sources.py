"""Models that are not in the registry: `torchvision:<builder>` (any torchvision classification builder:
resnet50, efficientnet_b0, ...) and `<module>:<function>`, the user's own code: `function(num_classes=,
in_channels=, image_size=)` (it receives only the arguments its signature names) returns an nn.Module; the
module is imported from the working directory or an installed package - it is code the user trusts, run as is.
"""

import difflib
import hashlib
import importlib
import inspect
import logging
import os
import sys

from torch import nn

from compress.errors import InputError

log = logging.getLogger(__name__)

TORCHVISION = "torchvision:"


def torchvision_builders():
    import torchvision.models
    from torchvision.models import list_models

    return list_models(module=torchvision.models)


def user_function(name):
    module_name, _, function_name = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python -m`/console scripts: the working directory is where users' code is
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InputError(f"cannot import module '{module_name}' for model '{name}' ({e}); run compress from the "
                         "folder that holds it, or install it") from None
    except Exception as e:  # the user's module failed while importing: say where
        raise InputError(f"importing '{module_name}' for model '{name}' failed ({e.__class__.__name__}: "
                         f"{str(e)[:160]})") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise InputError(f"module '{module_name}' has no function '{function_name}' (model '{name}')")
    return fn


def code_digest(name):
    """sha256 of the file that defines a user model (`<module>:<function>`), '' for registry and torchvision
    names: editing your model's code runs the stages that build it again. Only that file: a module it imports
    is not followed."""
    if ":" not in name or name.startswith(TORCHVISION):
        return ""
    try:
        path = inspect.getsourcefile(inspect.unwrap(user_function(name)))  # where it is defined, not re-exported
    except TypeError:  # a builtin or a class defined in C: nothing of the user's to follow
        return ""
    if not path or not os.path.isfile(path):
        return ""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def build_torchvision(name, in_channels, image_size, num_classes):
    """torchvision:<builder>, untrained, with the data's classes and channels."""
    from torchvision.models import get_model_builder

    arch = name[len(TORCHVISION):]
    aux = {"aux_logits": False, "init_weights": True} if arch in ("googlenet", "inception_v3") else {}  # one tensor
    model = get_model_builder(arch)(weights=None, num_classes=num_classes, **aux)
    return adapt_input_channels(model, in_channels)


def torchvision_problem(name):
    builder = name[len(TORCHVISION):]
    known = torchvision_builders()
    if builder in known:
        return None
    close = difflib.get_close_matches(builder, known, n=1)
    hint = f" (did you mean 'torchvision:{close[0]}'?)" if close else ""
    return (f"torchvision has no classification model '{builder}'{hint}; see torchvision.models.list_models() for "
            "the names")


def user_code_problem(name):
    try:
        user_function(name)
    except InputError as e:
        return str(e)
    return None


def build_user_model(name, in_channels, image_size, num_classes):
    """<module>:<function>: the user's function, given the arguments its signature names."""
    fn = user_function(name)
    offered = {"num_classes": num_classes, "in_channels": in_channels, "image_size": tuple(image_size)}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer everything
        params = None
    takes_all = params is None or any(p.kind == p.VAR_KEYWORD for p in params.values())  # `def f():` gets nothing
    try:
        model = fn(**{k: v for k, v in offered.items() if takes_all or k in params})
    except Exception as e:
        raise InputError(f"model function '{name}' failed ({e.__class__.__name__}: {str(e)[:160]})") from None
    if not isinstance(model, nn.Module):
        raise InputError(f"model function '{name}' returned {type(model).__name__}, not a torch.nn.Module")
    return model


def adapt_input_channels(model, in_channels):
    """Replace the first convolution when the images have another channel count than the model expects."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                if child.in_channels != in_channels:
                    setattr(parent, child_name, nn.Conv2d(
                        in_channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                        child.dilation, child.groups if child.groups == 1 else in_channels, child.bias is not None))
                return model
    return model
