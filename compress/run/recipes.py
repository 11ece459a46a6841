"""The shipped recipes (the repository's configs/*.yaml, installed as the package `compress.recipes`): found by
name - or by their repository path - from any folder, so `compress run -c cifar10` works outside a clone."""

import difflib
import importlib.resources
import os

from compress.errors import InputError

RENAMED = {"imagefolder-resnet18": "photos"}  # recipes under their older names


def _folder():
    return importlib.resources.files("compress.recipes")


def names():
    return sorted(p.name[:-5] for p in _folder().iterdir() if p.name.endswith(".yaml"))


def path_of(name):
    """The file of recipe `name`, or None."""
    candidate = _folder() / f"{name}.yaml"
    return str(candidate) if candidate.is_file() else None


def summary(name):
    """The first sentence of the recipe's opening comment (which may run over several lines), at most 150
    characters."""
    words = []
    with open(path_of(name), encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            words.append(line.lstrip("#").strip())
    text = " ".join(w for w in words if w)
    end = text.find(". ")
    text = text[:end + 1] if end >= 0 else text
    return text if len(text) <= 150 else text[:text.rfind(" ", 0, 148)] + " ..."


def resolve(value):
    """(config file, note): `value` itself when it is a file; else the shipped recipe it names ('cifar10', or
    'configs/cifar10.yaml' from outside a clone). An InputError lists the recipes when it is neither."""
    if value is None:
        return value, ""
    path = os.path.expanduser(value)
    recipe = path_of(value) if os.path.isdir(path) else None
    if recipe:  # `-c photos` run from a folder that holds a `photos/` of images: the recipe, not the folder
        return recipe, f"'{value}' is also a folder here; using the shipped recipe '{value}'"
    if os.path.exists(path):  # any other folder is refused by name when it is read
        return value, ""
    stem = os.path.splitext(os.path.basename(value))[0]
    if stem in RENAMED and path_of(stem) is None:
        return path_of(RENAMED[stem]), f"the recipe '{stem}' is now called '{RENAMED[stem]}'; using it"
    found = path_of(stem) if stem and (value == stem or value.endswith((".yaml", ".yml"))) else None
    if found:
        return found, ("" if value == stem else f"{value} is not here; using the shipped recipe '{stem}'")
    near = difflib.get_close_matches(stem, names(), n=1, cutoff=0.6)
    guess = f"did you mean '{near[0]}'? " if near else ""
    raise InputError(f"config file '{value}' not found, and it names no shipped recipe; {guess}pass an existing YAML "
                     f"file, or one of the recipes: {', '.join(names())} (compress config --list)")
