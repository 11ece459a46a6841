"""Image folders as users copy them: which folders are a dataset's splits (train/ or training/, and val/, valid/,
validation/, dev/, test/ or testing/, in any case) and which files and folders are no data (hidden ones, macOS's ._
files, __MACOSX/). Shared by training (`compress.data.imagefolder`) and `compress eval`/`predict`, so a folder means
the same to both."""

import os

TRAIN_FOLDERS = ("train", "training")  # the training split's folder
SPLIT_FOLDERS = ("val", "valid", "validation", "dev", "test", "testing")  # the held-out split's, in this order
JUNK = ("__MACOSX", "@eaDir", "$RECYCLE.BIN", "System Volume Information", "Thumbs.db", "desktop.ini")  # never data


def split_name(name):
    """The split a folder name means ('train' for train/ or training/, or the held-out split's name), in any
    case; None for others."""
    lower = name.lower()
    return "train" if lower in TRAIN_FOLDERS else lower if lower in SPLIT_FOLDERS else None


def skipped(name):
    """Folders and files a dataset copy carries that are no data: hidden ones (.DS_Store, macOS's ._photo.jpg
    AppleDouble files, .thumbnails/), and what archivers, NAS boxes and Windows leave (__MACOSX/, @eaDir/,
    Thumbs.db)."""
    return name.startswith(".") or name in JUNK


def class_folders(root):
    """The class folders under `root`, sorted (torchvision's order), hidden and junk folders left out."""
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not skipped(e.name))


def split_folders(root):
    """(train folder, held-out folder name) that `root` holds, either None: train/ (or training/) and the first of
    SPLIT_FOLDERS there is, matched in any case (Train/, Val/, Training/ with Testing/)."""
    if not os.path.isdir(root):
        return None, None
    found = {}
    for name in sorted(e.name for e in os.scandir(root) if split_name(e.name) and e.is_dir()):
        found.setdefault(split_name(name), name)
    held_out = next((found[s] for s in SPLIT_FOLDERS if s in found), None)
    return (os.path.join(root, found["train"]) if "train" in found else None), held_out


def loose_images(folder):
    """How many image files sit directly in `folder`, beside its class folders (so in no class)."""
    from compress.deploy.imageio import IMAGE_EXTENSIONS

    return sum(1 for e in os.scandir(folder) if not skipped(e.name) and e.name.lower().endswith(IMAGE_EXTENSIONS)
               and e.is_file())
