"""Users' own images: an image-folder tree (root/train/<class>/ with root/val/<class>/ or test/, or one flat
root/<class>/ tree split by seed), and a folder of unlabelled images for distillation (nested folders allowed)."""

import contextlib
import hashlib
import logging
import os
import unicodedata
from collections import Counter

import torch

from compress.data.builtin import augment_of
from compress.data.imageset import FINGERPRINT_BYTES, UNLABELLED, FileImages, ImageSet
from compress.data.pixels import UnreadableImages, raise_unreadable, unreadable_sentence
from compress.data.registry import input_shape_of
from compress.deploy import imageio
from compress.deploy.folders import SPLIT_FOLDERS, class_folders, loose_images, skipped, split_folders, split_name
from compress.errors import InputError
from compress.fileio import is_utf8_name, open_regular, sha256_file, walk_tree

log = logging.getLogger(__name__)


_listed = None  # {(what, folder, settings): result} while `listed_once()` holds it


@contextlib.contextmanager
def listed_once():
    """Within it each folder is listed once: the scan of data.root, the files of data.unlabeled and their digests
    are kept, so a run of four stages lists 1.28 M images once instead of at each stage's decision and load (9
    scans and 4 digests of data.root), and every stage trains on the listing its decision recorded. Images
    added while a run is going count at the next run, which sees that the listing changed."""
    global _listed
    outer = _listed
    _listed = {} if outer is None else outer
    try:
        yield
    finally:
        _listed = outer


def _once(key, compute):
    """compute(), or its result for `key` kept by `listed_once()` (errors are not kept: they are raised again)."""
    if _listed is None:
        return compute()
    if key not in _listed:
        _listed[key] = compute()
    return _listed[key]


def _root_key(cfg):
    return (os.path.abspath(os.path.expanduser(cfg.root)), cfg.val_fraction, cfg.split_seed, cfg.limit)


def scan(cfg):
    """The layout of data.root without decoding an image: {"layout": words, "classes": names, "train" and "val":
    [(path, class index)], "notes": [warnings]}. Three layouts: root/train/ with root/val/ (or another split name)
    used as given; root/train/ alone, split by data.split_seed; a flat root/<class>/ tree, split likewise. Every problem
    a user can make here (too few classes, an empty class, splits with other classes) is an InputError now.
    The result is shared within `listed_once()`: do not change it."""
    return _once(("scan",) + _root_key(cfg), lambda: _scan(cfg))


def _scan(cfg):
    root = os.path.expanduser(cfg.root)
    train_dir, held_out = split_folders(root)
    train_dir = train_dir or os.path.join(root, "train")
    notes, others = [], Counter()  # files in the class folders that are not images compress reads, by suffix
    if os.path.isdir(train_dir) and held_out:
        names, train = class_tree(train_dir, others)
        val_names, val = class_tree(os.path.join(root, held_out), others)
        _same_classes(root, names, val_names, held_out)
        notes += _split_overlap(root, train_dir, held_out, train, val)
        if cfg.limit:  # a seeded sample of the training folder
            keep = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.split_seed))[:cfg.limit]
            train = [train[i] for i in sorted(keep.tolist())]
        layout = f"{os.path.basename(train_dir)}/ and {held_out}/ folders, used as given"
        notes += _unused_splits(root, train_dir, held_out)
        given = (os.path.basename(train_dir), held_out)
    else:
        tree = train_dir if os.path.isdir(train_dir) else root
        parent = os.path.dirname(os.path.normpath(root))
        here = os.path.basename(os.path.normpath(root))
        if split_name(here) and any(split_folders(parent)) and any(
                split_name(e.name) and e.name != here for e in os.scandir(parent) if e.is_dir()):
            notes.append(f"data.root is the {os.path.basename(os.path.normpath(root))}/ folder of {parent}, which has "
                         f"other splits beside it: only this folder is used, split by data.split_seed; point "
                         f"data.root at {parent} to use its splits as given")
        names, samples = class_tree(tree, others)
        train_idx, val_idx = stratified_split([label for _, label in samples], cfg.val_fraction, cfg.split_seed)
        if samples and not val_idx:
            raise InputError(f"data.root: no class in '{imageio.printable(root)}' has two images, so none can be held "
                             "out for validation; add images (two or more of a class), or give a val/ folder beside "
                             "train/")
        train_idx = train_idx[:cfg.limit] if cfg.limit else train_idx
        train, val = [samples[i] for i in train_idx], [samples[i] for i in val_idx]
        notes += _flat_copies(val, train)
        where = (f"{os.path.basename(train_dir)}/ only (no val/ or test/ beside it)" if tree == train_dir
                 else "one folder per class")
        if tree == train_dir:
            notes += _unread_beside(root, train_dir, cfg)
        layout = (f"{where}: {cfg.val_fraction:.0%} of each class held out for validation by data.split_seed (at "
                  "least one image of a class of two or more)")
        given = None
    _refuse_empty(root, train + val)
    notes += _balance(names, train, val, given) + _turned(train + val)
    trees = [train_dir, os.path.join(root, held_out)] if given else [tree]
    for folder, loose in ((folder, loose_images(folder)) for folder in trees):
        if loose:
            notes.append(f"{loose:,} image(s) directly in '{imageio.printable(folder)}' are in no class folder and "
                         "are not used; move them into their class's folder")
    if others:
        kinds = ", ".join(f"{n:,} {suffix}" for suffix, n in others.most_common(5))
        renamed = [s for s in others if s in imageio.JPEG_ALIASES]
        notes.append(f"skipped {sum(others.values()):,} file(s) in the class folders that are not images compress "
                     f"reads ({kinds}); images in another format must be converted to one of "
                     f"{', '.join(imageio.IMAGE_EXTENSIONS)}"
                     + (f" ({', '.join(renamed)} files are JPEGs: renaming them to .jpg is enough)" if renamed else ""))
    return {"layout": layout, "classes": names, "train": train, "val": val, "notes": notes}


def _unused_splits(root, train_dir, held_out):
    """A note naming the split folders beside train/ that are not read (test/ beside val/: only the first held-out
    folder validates), so that images there are known to be left out - a test set kept apart, or a mistake."""
    unused = sorted(e.name for e in os.scandir(root) if e.is_dir() and split_name(e.name) and e.name != held_out
                    and os.path.join(root, e.name) != train_dir)
    if not unused:
        return []
    shown = ", ".join(f"{imageio.printable(name)}/" for name in unused)
    return [f"validation uses {held_out}/; {shown} beside it {'is' if len(unused) == 1 else 'are'} not used "
            f"(compress validates on the first of {', '.join(f'{n}/' for n in SPLIT_FOLDERS)} there is)"]


def _unread_beside(root, train_dir, cfg):
    """A note naming the folders beside train/ laid out as splits (class folders holding images) that are not read
    (eval/, holdout/): only the split names compress knows validate, so held-out images under another name would go
    unused. data.unlabeled and data.cache_dir, and folders that cannot be listed, are no split."""
    own = {os.path.realpath(os.path.expanduser(p)) for p in (cfg.unlabeled, cfg.cache_dir) if p}
    unread = []
    try:
        beside = sorted(e.name for e in os.scandir(root) if e.is_dir() and not skipped(e.name))
    except OSError:
        return []
    for name in beside:
        folder = os.path.join(root, name)
        if folder == train_dir or os.path.realpath(folder) in own:
            continue
        try:
            if any(loose_images(os.path.join(folder, c)) for c in class_folders(folder)[:20]):
                unread.append(name)
        except OSError:  # a folder this user cannot list (lost+found/): not a split of theirs
            continue
    if not unread:
        return []
    shown = ", ".join(f"{imageio.printable(name)}/" for name in unread[:5])
    return [f"{shown} beside {os.path.basename(train_dir)}/ {'is' if len(unread) == 1 else 'are'} not read: "
            f"validation images are taken from a folder named {', '.join(f'{n}/' for n in SPLIT_FOLDERS)}; rename it "
            "to one of those to validate on its images (without one, data.val_fraction of train/ is held out)"]


def _refuse_empty(root, items):
    """Empty image files (0 bytes) refused by name before anything is decoded: the dry run finds them too."""
    empty = [path for path, _ in items if _size(path) == 0]
    if empty:
        shown = ", ".join(f"'{imageio.printable(p)}'" for p in empty[:5])
        raise InputError(f"data.root: {len(empty):,} image file(s) under '{imageio.printable(root)}' are empty (0 "
                         f"bytes): {shown}{' and more' if len(empty) > 5 else ''}; fix or remove them")


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:  # a dangling link: the decode names it, with what to do
        return None


SAMPLED = 200  # headers read for the EXIF orientation note: ~20 ms, spread evenly over the images


def _turned(items):
    """A note when sampled images carry an EXIF rotation: they are used as stored, so a photo a viewer shows
    upright is seen (and deployed) turned, unless the files are rotated first."""
    sample = [items[i * len(items) // SAMPLED][0] for i in range(SAMPLED)] if len(items) > SAMPLED else \
        [path for path, _ in items]
    turned = [path for path in sample if imageio.exif_turned(path)]
    if not turned:
        return []
    sampled = " sampled" if len(sample) < len(items) else ""
    return [f"{len(turned)} of {len(sample):,} images{sampled} (e.g. {turned[0]}) carry an EXIF orientation that tells "
            "a viewer to rotate them; compress uses pixels as stored (as torchvision, timm and the exported file's "
            "rule do), so it trains on them turned: if your app rotates photos by EXIF before inference, rotate the "
            "files first (e.g. mogrify -auto-orient)"]


def stratified_split(labels, val_fraction, seed):
    """(training indices, validation indices): val_fraction of every class held out (rounded; at least one image of
    a class with two or more, never its last one), drawn by `seed`; both lists in one seeded random order, so
    data.limit's first N training images are a random sample. Stratified as scikit-learn's train_test_split(stratify=)
    is: a random split of a small folder can leave a class with no validation image, or with ten times its share."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)).tolist()
    sizes = Counter(labels)
    quota = {c: min(n - 1, max(1 if n > 1 else 0, round(n * val_fraction))) for c, n in sizes.items()}
    taken, train, val = Counter(), [], []
    for i in order:
        c = labels[i]
        if taken[c] < quota[c]:
            taken[c] += 1
            val.append(i)
        else:
            train.append(i)
    return train, val


def _balance(names, train, val, given=None):
    """Warnings a user needs before training on these splits: a class with no training or no validation image,
    classes of very different sizes, and a validation split too small to tell models apart. `given`: the
    (training, validation) folders when the splits are used as given, where data.val_fraction does nothing."""
    notes = []
    more = {"training": f"add images to {given[0]}/", "validation": f"add images to {given[1]}/"} if given else {
        "training": "add images (or change data.val_fraction / data.split_seed)",
        "validation": "add images (or change data.val_fraction / data.split_seed)"}
    for split, items, what in (("training", train, "the model cannot learn it"),
                               ("validation", val, "its accuracy is not measured")):
        counts = Counter(label for _, label in items)
        missing = [names[i] for i in range(len(names)) if not counts[i]]
        if missing:
            notes.append(f"no {split} image of class {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: "
                         f"{what}; {more[split]}")
    counts = Counter(label for _, label in train + val)
    big, small = max(counts, key=counts.get), min(counts, key=counts.get)
    if counts[big] >= 10 * counts[small]:
        share = 100 * sum(y == big for _, y in val) / max(1, len(val))
        notes.append(f"the classes are imbalanced ({names[big]}: {counts[big]:,} images, {names[small]}: "
                     f"{counts[small]:,}): always answering {names[big]} scores {share:.0f} % on validation, so read "
                     "accuracies against that")
    if 0 < len(val) < 100:
        notes.append(f"only {len(val)} validation image(s): each one is {100 / len(val):.1f} points of accuracy, so "
                     "small differences between models are noise; "
                     + (f"add images to {given[1]}/" if given else "add images or raise data.val_fraction"))
    return notes


def listing_digest(cfg, key):
    """A digest of the images data.<key> ("root" or "unlabeled") lists, decoding none: the class names and, for
    each image, its path inside the folder, its size in bytes and its label (for data.root as `scan` splits it).
    Images added, removed, renamed, moved between classes or replaced by a file of another size change it; the
    same folder copied elsewhere does not. '' when data.root is not an image folder (a built-in dataset)."""
    if key == "root" and cfg.name != "imagefolder":
        return ""
    what = _root_key(cfg) if key == "root" else (os.path.abspath(os.path.expanduser(cfg.unlabeled)),)
    return _once(("digest", key) + what, lambda: _listing_digest(cfg, key))


def _listing_digest(cfg, key):
    h = hashlib.sha256()
    if key == "root":
        found = scan(cfg)
        root = os.path.expanduser(cfg.root)
        h.update("\0".join(found["classes"]).encode())
        splits = (("train", found["train"]), ("val", found["val"]))
    else:
        root = os.path.expanduser(cfg.unlabeled)
        splits = (("unlabeled", [(path, -1) for path in unlabeled_files(cfg)]),)
    for split, items in splits:
        h.update(f"\n{split}:{len(items)}".encode())
        start = len(os.path.join(root, ""))
        for path, label in items:
            try:
                size = os.path.getsize(path)
            except OSError:  # a dangling link, or removed since the scan
                raise InputError(f"image '{path}' not found (a broken link?); fix or remove it") from None
            # a file name that is not UTF-8 (its bytes kept as surrogates) hashes as its bytes on disk
            h.update(f"\n{path[start:]}\0{size}\0{label}".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def bytes_digest(cfg, key):
    """A digest of the bytes of the images data.<key> lists, in the listing's order: every file's while they
    come to FINGERPRINT_BYTES in all, beyond that an even sample (as the pixel cache's key), so an image edited
    in place at the same size (an uncompressed format keeps every image of a size at one file size) changes it
    where the listing cannot; the same folder copied elsewhere does not."""
    if key == "root" and cfg.name != "imagefolder":
        return ""
    what = _root_key(cfg) if key == "root" else (os.path.abspath(os.path.expanduser(cfg.unlabeled)),)
    return _once(("bytes", key) + what, lambda: _bytes_digest(cfg, key))


def _bytes_digest(cfg, key):
    if key == "root":
        found = scan(cfg)
        paths = [path for split in ("train", "val") for path, _ in found[split]]
    else:
        paths = unlabeled_files(cfg)
    sizes = [os.path.getsize(path) for path in paths]  # each listed (and sized) just before, by listing_digest
    step = max(1, -(-sum(sizes) // FINGERPRINT_BYTES))
    h = hashlib.sha256(f"{len(paths)}:{step}".encode())
    for path in paths[::step]:
        h.update(bytes.fromhex(sha256_file(path, follow_links=True, what="image")))
    return h.hexdigest()


def load_imagefolder(cfg, seed, place=None):
    """Training and validation sets of image files laid out as `scan` found them, decoded once (into the run's
    pixel cache at `place`, when given)."""
    found = scan(cfg)
    channels, size, _ = input_shape_of(cfg)
    rule = imageio.resize_rule(size, cfg.eval_crop)
    budget = cfg.cache_mb * 2**20
    augment = augment_of(cfg, seed, True)

    def subset(items, augment):
        storage = FileImages([p for p, _ in items], (channels, size, size), rule,
                             keep_original=augment is not None and augment.kind == "random_resized_crop",
                             cache_bytes=budget, place=place, role="train" if augment is not None else "val")
        return ImageSet([label for _, label in items], (channels, size, size), storage, augment, rule)

    how = f"{found['layout']}: {len(found['train'])}/{len(found['val'])} images"
    sets, unreadable = [], []
    for items, aug in ((found["train"], augment), (found["val"], None)):  # both decoded: every bad file named once
        try:
            sets.append(subset(items, aug))
        except UnreadableImages as e:
            unreadable.append(e)
    raise_unreadable(unreadable, place)
    return sets[0], sets[1], tuple(found["classes"]), how


def class_tree(root, others=None):
    """(class names, [(path, class index)]) of root/<class>/<image> - the order torchvision's ImageFolder uses
    (classes sorted; files by sorted os.walk, then name), hidden files and junk folders left out - refusing fewer
    than 2 classes, an empty one, and a tree that is one level too high (a "class" holding train/ or val/).
    `others` (a Counter) counts the files by suffix that are no image it reads (.heic, .gif, .txt)."""
    names = class_folders(root)
    if len(names) < 2:
        hint = ""
        if os.path.isdir(os.path.join(root, "cifar-10-batches-py")) or os.path.basename(
                os.path.normpath(root)) == "cifar-10-batches-py":
            hint = ("; it holds torchvision's CIFAR-10 download, which data.name=cifar10 reads (as -c cifar10-tutorial "
                    "does)")
        raise InputError(f"data.root: '{root}' must hold one folder per class (<class>/<image>); found {len(names)} "
                         f"class folder{'s' if len(names) != 1 else ''}{hint}")
    _check_class_folders(root, names)
    samples = []
    for index, name in enumerate(names):
        files, passed = [], Counter()  # this class's files that are no image it reads, by suffix
        for folder, names_here in _walk(os.path.join(root, name)):
            prefix = os.path.join(folder, "")  # one join a folder, not one a file: 1.28 M files are listed in seconds
            for f in sorted(names_here):
                if skipped(f):
                    continue
                if _is_image_name(f):
                    files.append(prefix + f)
                else:
                    passed[os.path.splitext(f)[1].lower() or f] += 1
        if not files:  # a class of .heic photos: say which files were passed over, not only that none was read
            kinds = ", ".join(imageio.printable(suffix, 20) for suffix, _ in passed.most_common(5))
            kinds += ", ..." if len(passed) > 5 else ""
            why = (f": {sum(passed.values()):,} file(s) skipped ({kinds}); convert them to one of "
                   f"{', '.join(imageio.IMAGE_EXTENSIONS)}" if passed else "; add images or remove the folder")
            raise InputError(f"data.root: class folder '{os.path.join(root, name)}' holds no images (.jpg, .png, "
                             f"...){why}")
        if others is not None:
            others.update(passed)
        samples.extend((f, index) for f in files)
    return names, samples


def _check_class_folders(root, names):
    """Refuse class folders that are not UTF-8 names, two classes in one folder, a link to a folder holding the root
    itself, a split folder among the classes, and a class folder holding splits (data.root one level too high)."""
    root_real = os.path.realpath(root)
    seen = {}  # real folder -> class name: two classes in one folder would give every image two labels
    for name in names:
        if not is_utf8_name(name):
            raise InputError(f"data.root: the class folder '{os.path.join(root, name)}' has a name that is not UTF-8 "
                             "text; rename it (class names are written into the ONNX files and the reports)")
        real = os.path.realpath(os.path.join(root, name))
        if real in seen:
            raise InputError(f"data.root: the class folders '{os.path.join(root, seen[real])}' and "
                             f"'{os.path.join(root, name)}' are the same folder ('{real}', through a link): each image "
                             "would be two classes; give each class its own folder of images")
        seen[real] = name
        if root_real == real or root_real.startswith(real.rstrip(os.sep) + os.sep):  # every class's images in one
            raise InputError(f"data.root: the class folder '{os.path.join(root, name)}' is a link to '{real}', which "
                             f"holds '{root}' itself; replace the link with the class's own folder of images")
        if split_name(name) and {e.name for e in os.scandir(os.path.join(root, name)) if e.is_dir()} & set(names):
            # val/cat/ beside cat/: a split, not a class named "val"
            raise InputError(f"data.root: '{root}' holds a '{name}' folder of class folders beside its class folders; "
                             f"use {root}/train/<class>/ with {root}/{name}/<class>/, or one folder per class")
        if any(split_folders(os.path.join(root, name))):
            inner = os.path.join(root, name)
            raise InputError(f"data.root: the class folder '{inner}' holds train/ or val/ folders itself: data.root "
                             f"is one level too high; set data.root={inner}")


def _walk(top):
    """[(folder, file names)] under `top`, following links, sorted by folder (torchvision's order), without hidden
    or junk folders, each folder once (a link loop, cat/up -> .., adds nothing: `walk_tree`)."""
    return sorted(walk_tree(top, skip=skipped, what="data.root", read=_is_image_name))


def _same_classes(root, train_names, val_names, held_out):
    only_train = sorted(set(train_names) - set(val_names))
    only_val = sorted(set(val_names) - set(train_names))
    alike = {unicodedata.normalize("NFC", n): n for n in only_val}
    for name in only_train:  # café typed on one system, copied from macOS (which writes é as e + accent) on another
        if unicodedata.normalize("NFC", name) in alike:
            other = alike[unicodedata.normalize("NFC", name)]
            raise InputError(f"data.root '{root}': class '{name}' in train/ and '{other}' in {held_out}/ look alike "
                             f"but are written with different Unicode characters ({ascii(name)} and {ascii(other)}: "
                             "one spells an accent as a separate mark, as macOS does); rename one folder so both "
                             "splits spell the class the same way")
    if only_train or only_val:
        which = (f"class '{only_train[0]}' is in train/ but not in {held_out}/" if only_train
                 else f"class '{only_val[0]}' is in {held_out}/ but not in train/")
        raise InputError(f"data.root '{root}': {which}; both splits need the same class folders")


COPY_SAMPLE = 50  # validation images compared with their class's training images (by size, then sha256)


def _split_overlap(root, train_dir, held_out, train, val):
    """Refuse a validation folder that holds the training images - the same folder through a link, links to
    training files, or byte-identical copies in at least half of a sample of COPY_SAMPLE validation images
    (`cp -r train val`): accuracy on images trained on says nothing about new photos. Fewer copies (datasets have
    a few duplicates) are a note. Only files of a size found in the same class are read."""
    held_dir = os.path.join(root, held_out)
    fix = f"put held-out images in {held_dir}, or remove it to split train/ by data.split_seed"
    if os.path.realpath(held_dir) == os.path.realpath(train_dir):
        raise InputError(f"data.root: '{held_dir}' is the training folder '{train_dir}' (through a link): validation "
                         f"accuracy on the training images says nothing about new photos; {fix}")
    trained = {os.path.realpath(path): path for path, _ in train}
    linked = [(path, trained[os.path.realpath(path)]) for path, _ in val if os.path.realpath(path) in trained]
    if linked:
        raise InputError(f"data.root: {len(linked):,} of the {len(val):,} images in {held_out}/ are training images "
                         f"through links (e.g. '{linked[0][0]}' is '{linked[0][1]}'): validation accuracy on them says "
                         f"nothing about new photos; {fix}")
    sample, copies = copies_of_training_images(train, val)
    if not copies:
        return []
    told = (f"{len(copies)} of {len(sample)} {'sampled ' if len(sample) < len(val) else ''}images in {held_out}/ are "
            f"byte-identical copies of training images (e.g. '{copies[0][0]}' of '{copies[0][1]}')")
    if 2 * len(copies) >= len(sample):
        raise InputError(f"data.root: {told}: {held_out}/ holds the training images, and validation accuracy on them "
                         f"says nothing about new photos; {fix}")
    return [f"{told}: the validation accuracy counts them, which reads higher than on new photos"]


def copies_of_training_images(train, val):
    """(the validation images looked at, [(validation image, training image it copies)]): every validation image, or
    COPY_SAMPLE evenly spaced ones of a larger split; a copy is the same file (through a link) or the same bytes in
    the same class. Only files of a size found in the same class are read."""
    sample = [val[i * len(val) // COPY_SAMPLE] for i in range(COPY_SAMPLE)] if len(val) > COPY_SAMPLE else val
    by_class = {}
    for path, label in train:
        by_class.setdefault(label, []).append(path)
    copies = []
    for label in sorted({label for _, label in sample}):
        copies += _same_bytes([path for path, k in sample if k == label], by_class.get(label, []))
    return sample, copies


def _flat_copies(val, train):
    """The note for a folder split by data.split_seed whose validation share holds copies of training images
    (`IMG_1 (1).jpg` beside `IMG_1.jpg`, a folder copied into its class): they were split apart, and the validation
    accuracy counts images trained on."""
    sample, copies = copies_of_training_images(train, val)
    if not copies:
        return []
    return [f"{len(copies)} of the {len(sample)} {'sampled ' if len(sample) < len(val) else ''}validation images split "
            f"off by data.split_seed are byte-identical copies of training images (e.g. '{copies[0][0]}' of "
            f"'{copies[0][1]}'): the validation accuracy counts them, which reads higher than on new photos; remove "
            "the duplicate files"]


def _is_image_name(name):
    return name.lower().endswith(imageio.IMAGE_EXTENSIONS)


def image_files(root, what="data.unlabeled", others=None):
    """Every image file under `root` (nested folders included, hidden ones skipped, each folder once however links
    loop: `walk_tree`), sorted; the other files counted by suffix into `others` (a Counter) when given."""
    found = []
    for folder, files in walk_tree(root, skip=skipped, what=what, read=_is_image_name):
        prefix = os.path.join(folder, "")
        found.extend(prefix + f for f in files if _is_image_name(f))
        if others is not None:
            others.update(os.path.splitext(f)[1].lower() or f for f in files if not _is_image_name(f))
    return found


def unlabeled_files(cfg):
    """The image files under data.unlabeled, or one clear error: the folder is missing, or holds no image."""
    return _unlabeled_listing(cfg)[0]


def unlabeled_skipped(cfg):
    """The files under data.unlabeled that are not read (no image suffix), counted by suffix."""
    return _unlabeled_listing(cfg)[1]


def _unlabeled_listing(cfg):
    return _once(("unlabeled", os.path.abspath(os.path.expanduser(cfg.unlabeled))), lambda: _unlabeled_files(cfg))


def _unlabeled_files(cfg):
    root = os.path.expanduser(cfg.unlabeled)
    if not os.path.isdir(root):
        raise InputError(f"data.unlabeled: folder '{cfg.unlabeled}' does not exist; point it at a folder of images")
    others = Counter()
    files = image_files(root, others=others)
    if not files:
        raise InputError(f"data.unlabeled: folder '{cfg.unlabeled}' holds no image files (.jpg, .png, .bmp, ...); "
                         "point it at a folder of images")
    return files, others


def unlabeled_problem(cfg):
    """data.unlabeled's problem as one sentence, or '': the folder is missing, holds no image, holds labelled
    images (`overlap_problem`), or holds files that are not images by their header. Only headers are read (0.5 s
    for 20,000 files here), so the distill stage does not stop on a file that is no image after the teacher has
    trained; a truncated image is still found only when distill decodes it."""
    try:
        files = unlabeled_files(cfg)
        overlap = overlap_problem(cfg)
    except InputError as e:
        return str(e)
    if overlap:
        return overlap
    bad = []
    for path in files:
        try:
            imageio.open_image(path, decode=False)
        except InputError as e:
            bad.append((path, str(e)))
    return f"data.unlabeled: {unreadable_sentence(bad, len(files))}" if bad else ""


def labelled_folders(cfg):
    """The folders whose every image is labelled data: data.root's train/ and held-out folders, or data.root
    itself (one folder per class, or train/ alone)."""
    root = os.path.expanduser(cfg.root)
    train, held_out = split_folders(root)
    if train and held_out:
        return [train, os.path.join(root, held_out)]
    return [train or root]


def overlap_problem(cfg):
    """One sentence when data.unlabeled holds labelled images, else '': the same folder (or one inside the other)
    as data.root's labelled folders, a link to a labelled image, or a copy of one (the same bytes: files of equal
    size are compared by sha256). Validation images among the unlabelled ones would be distilled on and inflate
    the gain the report states; training images would count twice."""
    if not cfg.root:
        return ""
    unlabeled = os.path.realpath(os.path.expanduser(cfg.unlabeled))
    if unlabeled == os.path.realpath(os.path.expanduser(cfg.root)):
        return (f"data.unlabeled: '{cfg.unlabeled}' is data.root: its labelled images would be distilled on as "
                "unlabelled ones (validation images inflate the gain the report states); point data.unlabeled at "
                "images that are not in data.root")
    for folder in (labelled_folders(cfg) if cfg.name == "imagefolder" else [os.path.expanduser(cfg.root)]):
        real = os.path.realpath(folder)
        if _inside(unlabeled, real) or _inside(real, unlabeled):
            how = "is" if real == unlabeled else "is inside" if _inside(unlabeled, real) else "holds"
            return (f"data.unlabeled: '{cfg.unlabeled}' {how} the labelled folder '{folder}' of data.root: its "
                    "labelled images would be distilled on as unlabelled ones (validation images inflate the gain the "
                    "report states); point data.unlabeled at images that are not in data.root")
    if cfg.name != "imagefolder":
        return ""
    return _once(("overlap",) + _root_key(cfg) + (unlabeled,), lambda: _file_overlap(cfg))


def _inside(path, folder):
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _file_overlap(cfg):
    found = scan(cfg)
    val = {path for path, _ in found["val"]}
    labelled = {}  # realpath -> the labelled path
    for path, _ in found["train"] + found["val"]:
        labelled.setdefault(os.path.realpath(path), path)
    files = unlabeled_files(cfg)
    same = [(u, labelled[os.path.realpath(u)]) for u in files if os.path.realpath(u) in labelled]
    found = {u for u, _ in same}
    same += _same_bytes([u for u in files if u not in found], list(labelled.values()))
    if not same:
        return ""
    in_val = [pair for pair in same if pair[1] in val]
    u, path = (in_val or same)[0]
    what = ("a validation image: distilling on it inflates the gain the report states" if in_val else
            "a training image: it would count twice")
    return (f"data.unlabeled: {len(same):,} of its images are labelled images of data.root ({len(in_val):,} of them "
            f"validation images), by path or by identical bytes - e.g. '{u}' is '{path}', {what}; remove them from "
            f"'{cfg.unlabeled}' or point data.unlabeled at other images")


def _same_bytes(unlabelled, labelled):
    """[(unlabelled path, labelled path)] of the unlabelled files whose bytes are a labelled file's: only files of a
    size found on both sides are read (hashed with sha256)."""
    def sizes(paths):
        out = {}
        for path in paths:
            try:
                out.setdefault(os.path.getsize(path), []).append(path)
            except OSError:
                continue
        return out

    mine, theirs = sizes(unlabelled), sizes(labelled)
    digests, same = {}, []
    for size in sorted(set(mine) & set(theirs)):
        for path in theirs[size]:
            digests.setdefault(_file_sha256(path), path)
        same.extend((u, digests[d]) for u in mine[size] if (d := _file_sha256(u)) in digests)
    return same


def _file_sha256(path):
    try:
        with open(open_regular(path, "image", follow_links=True), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except InputError:
        return f"unreadable {path}"  # matches nothing: its header check names it


def load_unlabeled(cfg, train, place=None):
    """data.unlabeled's images as a set with label -1, at the training images' shape and rules, decoded once
    like them (so an unreadable file is found here, naming it)."""
    files = unlabeled_files(cfg)
    try:
        storage = FileImages(files, train.image_shape, train.rule,
                             keep_original=train.augment.kind == "random_resized_crop",
                             cache_bytes=cfg.cache_mb * 2**20, place=place, role="unlabeled")
    except UnreadableImages as e:
        raise_unreadable([e], place)
    return ImageSet([UNLABELLED] * len(files), train.image_shape, storage, train.augment, train.rule)
