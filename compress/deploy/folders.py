"""Image folders as users copy them: which folders are a dataset's splits (train/ and val/, valid/, validation/
or test/, in any case) and which files and folders are no data (hidden ones, macOS's ._ files, __MACOSX/). Shared
by training (`compress.data.imagefolder`) and `compress eval`/`predict`, so a folder means the same to both."""

import os

SPLIT_FOLDERS = ("val", "valid", "validation", "test")  # the held-out split's folder, in this order of preference
JUNK = ("__MACOSX", "@eaDir", "$RECYCLE.BIN", "System Volume Information", "Thumbs.db", "desktop.ini")  # never data


def split_name(name):
    """The split a folder name means ('train', or the held-out split's name), in any case; None for others."""
    lower = name.lower()
    return lower if lower in ("train", *SPLIT_FOLDERS) else None


def skipped(name):
    """Folders and files a dataset copy carries that are no data: hidden ones (.DS_Store, macOS's ._photo.jpg
    AppleDouble files, .thumbnails/), and what archivers, NAS boxes and Windows leave (__MACOSX/, @eaDir/,
    Thumbs.db)."""
    return name.startswith(".") or name in JUNK


def class_folders(root):
    """The class folders under `root`, sorted (torchvision's order), hidden and junk folders left out."""
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not skipped(e.name))


def split_folders(root):
    """(train folder, held-out folder name) that `root` holds, either None: train/ and val/, valid/, validation/
    or test/ (the first of these there is), matched in any case (Train/, Val/)."""
    if not os.path.isdir(root):
        return None, None
    found = {}
    for name in sorted(e.name for e in os.scandir(root) if split_name(e.name) and e.is_dir()):
        found.setdefault(split_name(name), name)
    held_out = next((found[s] for s in SPLIT_FOLDERS if s in found), None)
    return (os.path.join(root, found["train"]) if "train" in found else None), held_out
