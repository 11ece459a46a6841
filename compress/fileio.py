"""Files: atomic writes, strict JSON, sha256, and reads that never follow a symbolic link or block on a pipe.

Every file compress writes goes through `atomic_write_bytes`: a temp file in the same folder, fsync, then
`os.replace`, so a reader (or a crash) sees the old file or the new one, never half of one. `os.replace`
swaps the directory entry itself, so a link planted under a final name is replaced, not written through.
JSON is strict: non-finite numbers become null instead of the bare `NaN`/`Infinity` that JSON does not allow.
"""

import hashlib
import json
import math
import os
import stat
import tempfile

from compress.errors import InputError

MAX_JSON_BYTES = 64 * 1024 * 1024  # manifests and reports are kilobytes; anything this big is not ours


def _umask():
    # Python has no getter for the umask; set-and-restore is the portable way (read at write time, not import)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path, data):
    """Write to a temp file in the same folder, fsync, then rename over `path`: readers see old or new."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def _fsync_dir(folder):
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path, text):
    atomic_write_bytes(path, text.encode("utf-8"))


def finite(obj):
    """`obj` with every non-finite float replaced by None (recursively): what strict JSON can hold."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj, indent=None):
    """Strict JSON text: never NaN or Infinity."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)


def atomic_write_json(path, obj):
    atomic_write_text(path, dumps(obj, indent=2) + "\n")


def open_regular(path, what="file", follow_links=False):
    """A read-only file descriptor for `path` that is a regular file reached without a symbolic link as its
    last component (unless `follow_links`, for files the user names outside a run directory): a link, a
    folder, a pipe or a device is refused with an InputError naming it (a FIFO would block a plain `open`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW))
    except FileNotFoundError:
        raise InputError(f"{what} '{path}' not found") from None
    except OSError as e:
        if os.path.islink(path):
            raise InputError(f"{what} '{path}' is a symbolic link; compress does not read or write through "
                             "links inside a run directory - replace it with the file itself") from None
        if os.path.isdir(path):
            raise InputError(f"{what} '{path}' is a directory, not a file") from None
        raise InputError(f"cannot read {what} '{path}' ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{what} '{path}' is not a regular file (a pipe, device or socket); replace it with the "
                         "file itself")
    os.set_blocking(fd, True)
    return fd


def read_bytes(path, what="file", limit=None, follow_links=False):
    """The bytes of a regular file (see `open_regular`), refusing files larger than `limit`."""
    fd = open_regular(path, what, follow_links)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise InputError(f"{what} '{path}' is {size:,} bytes, far more than compress ever writes there; "
                             "restore it or move it away")
        return f.read() if limit is None else f.read(limit + 1)


def read_json(path, what="file", limit=MAX_JSON_BYTES):
    """Parsed JSON of a regular file; InputError naming the file when it is not (valid, strict) JSON."""
    data = read_bytes(path, what, limit)
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: brackets nested thousands deep
        raise InputError(f"{what} '{path}' is not valid JSON ({e.__class__.__name__}); restore it, or move it "
                         "away and rerun the stage that wrote it") from None


def _refuse_constant(name):
    raise ValueError(f"non-finite number {name}")


def sha256_file(path, follow_links=False):
    fd = open_regular(path, follow_links=follow_links)
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def links_under(root):
    """Run-relative paths of every symbolic link inside `root` (compress never writes through one)."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(folder, name)
            if os.path.islink(full):
                found.append(os.path.relpath(full, root))
    return sorted(found)
