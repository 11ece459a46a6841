"""Files: atomic writes, strict JSON, sha256, reads that never follow a symbolic link or block on a pipe, one
bounded folder walk, and text from files made safe for a terminal.

Every file compress writes goes through `atomic_write_bytes`: a temp file in the same folder, fsync, then
`os.replace`, so a reader (or a crash) sees the old file or the new one, never half of one. `os.replace`
swaps the directory entry itself, so a link planted under a final name is replaced, not written through.
A write the system refuses (a full disk, a read-only file system, a folder in the file's place) is one
sentence naming the file, never a bare OSError.
JSON is strict: non-finite numbers become null instead of the bare `NaN`/`Infinity` that JSON does not allow.
"""

import errno
import hashlib
import json
import logging
import math
import os
import stat
import tempfile

from compress.errors import InputError

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 64 * 1024 * 1024  # manifests and reports are kilobytes; anything this big is not ours


def _umask():
    # Python has no getter for the umask; set-and-restore is the portable way (read at write time, not import)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path, data):
    """Write to a temp file in the same folder, fsync, then rename over `path`: readers see old or new. A write
    the system refuses is an InputError naming `path` and what to do (`write_problem`); the file under `path`
    is then what it was before."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        if os.path.isdir(path) and not os.path.islink(path):  # os.replace would say only "Is a directory"
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and write_problem(e, path):
            raise InputError(write_problem(e, path)) from None
        raise
    _fsync_dir(folder)


# errno -> what the user reads and does; the file the system refused is named before it
_WRITE_ERRORS = {
    errno.ENOSPC: "the disk is full; free space there (or use another --run-dir) and rerun the same command - the "
                  "files already written are kept",
    errno.EDQUOT: "the disk quota is used up; free space there (or use another --run-dir) and rerun the same command "
                  "- the files already written are kept",
    errno.EFBIG: "the file is larger than this system allows (ulimit -f); raise the limit and rerun",
    errno.EROFS: "the file system is read-only; use another --run-dir, or mount it writable",
    errno.EACCES: "no permission to write there; use another --run-dir, or make it writable",
    errno.EPERM: "no permission to write there; use another --run-dir, or make it writable",
    errno.EISDIR: "a folder is in its place; move the folder away and rerun",
    errno.ENOTDIR: "a file is in the place of one of its folders; move that file away and rerun",
}


def write_problem(error, path=None):
    """One sentence for an OSError a write got ('' for an errno that is not about where the file goes): the
    file's name (`path`, else the error's own) and what to do."""
    what = _WRITE_ERRORS.get(getattr(error, "errno", None))
    if not what:
        return ""
    name = path or getattr(error, "filename", None)
    return f"cannot write '{safe_text(str(name))}': {what}" if name else f"cannot write: {what}"


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


def read_bytes(path, what="file", limit=None, follow_links=False, too_large=None):
    """The bytes of a regular file (see `open_regular`), refusing files larger than `limit` (with `too_large`,
    or a sentence for a file compress wrote)."""
    fd = open_regular(path, what, follow_links)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise InputError(too_large or f"{what} '{path}' is {size:,} bytes, far more than compress ever writes "
                             "there; restore it or move it away")
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


def sha256_file(path, follow_links=False, what="file"):
    fd = open_regular(path, what, follow_links=follow_links)
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def open_append(path, what="file"):
    """A text file object appending to `path` (created when missing), which must be a regular file reached without
    a symbolic link: a pipe, a device, a folder or a link in its place is an InputError naming it, never a
    blocking open (opening a FIFO to write waits for a reader forever)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if os.path.islink(path):
            raise InputError(f"{what} '{path}' is a symbolic link; compress does not write through links inside a "
                             "run directory - remove it") from None
        if e.errno == errno.ENXIO or (os.path.exists(path) and not os.path.isfile(path)):
            raise InputError(f"{what} '{path}' is not a regular file ({_kind(path)}); remove it and rerun") from None
        raise InputError(write_problem(e, path) or f"cannot write {what} '{path}' ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{what} '{path}' is not a regular file ({_kind(path)}); remove it and rerun")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


def _kind(path):
    """What is at `path` instead of a regular file, in words."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "gone"
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a pipe"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return words
    return "not a file"


def strange_entries(root):
    """[(run-relative path, what it is)] of every entry inside `root` that is neither a regular file nor a folder
    (symbolic links, pipes, sockets, devices), sorted: compress writes through none and reads none of them (a pipe
    would block the read). Not followed into links, so the walk ends."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(folder, name)
            mode = os.lstat(full).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                found.append((os.path.relpath(full, root), _kind(full)))
    return sorted(found)



def walk_tree(top, skip=lambda name: False, what=None, read=None):
    """[(folder, sorted file names)] of `top` and every folder below it, links to folders followed, in os.walk's
    top-down order with names sorted - but each folder read once: folders are known by (st_dev, st_ino), so a
    link back into the tree (`ln -s . loop`), a second link to a folder already read, or a link to a folder
    enclosing `top` adds nothing, and the walk ends whatever the links. `skip(name)` leaves out files and folders
    by name; `what` ("data.root") names the setting in the warning about a link not followed. A file whose name
    `read(name)` says will be read, but that is a pipe, a socket or a device (itself or through a link), is refused
    naming it: reading it would wait forever (a pipe) or without end (/dev/zero)."""
    top_real = os.path.realpath(top)
    seen, found, stack = set(), [], [top]
    while stack:
        folder = stack.pop()
        try:
            info = os.stat(folder)
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:  # unreadable, or gone since it was listed: os.walk leaves it out too
            continue
        real = os.path.realpath(folder)
        if (info.st_dev, info.st_ino) in seen or (folder != top and (
                real == top_real or top_real.startswith(real.rstrip(os.sep) + os.sep))):
            if what and folder not in _NOT_FOLLOWED:  # a tree is listed more than once a run: say it once
                _NOT_FOLLOWED.add(folder)
                log.warning("%s: not following %s: it links back to a folder already read", what, folder)
            continue
        seen.add((info.st_dev, info.st_ino))
        files, below = [], []
        for entry in entries:
            if skip(entry.name):
                continue
            try:
                is_dir = entry.is_dir()  # through a link too
            except OSError:
                is_dir = False
            if not is_dir and read is not None and read(entry.name):
                _refuse_special(entry, what)
            (below if is_dir else files).append(entry.path if is_dir else entry.name)
        found.append((folder, files))
        stack.extend(reversed(below))
    return found


_NOT_FOLLOWED = set()


def _refuse_special(entry, what):
    try:
        if entry.is_file():  # a regular file, through a link too (the common case: no further stat)
            return
        mode = os.stat(entry.path).st_mode
    except OSError:  # a dangling link: the image checks name it
        return
    if stat.S_ISREG(mode):
        return
    via = " through a link" if entry.is_symlink() else ""
    raise InputError(f"{what or 'folder'}: '{entry.path}' is {_kind(os.path.realpath(entry.path))}{via}, named like "
                     "an image; reading it would never end - remove it and rerun")


def is_utf8_name(name):
    """Whether a name from the file system is UTF-8 text: bytes that are not come back as surrogates (\\udcff),
    which JSON, ONNX metadata and some libraries refuse."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def safe_text(text):
    """`text` (a file or folder name, a class name, a message read from a file or raised by a library) safe to
    show on a terminal or write to a log: every control or other non-printable character but the line break is
    escaped (an ESC from a file name would otherwise drive the terminal). Idempotent."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode("ascii") for c in text)


def one_line(text):
    """`safe_text` with line breaks escaped too: for a name or a message read from a file that is shown on one line
    of its own (a file named 'a.png: 7 (100.0%)\\nb.png' would otherwise print a line compress did not write)."""
    return safe_text(text).replace("\n", "\\n")


class SafeFormatter(logging.Formatter):
    """A log formatter whose every line is `safe_text`: one place, so no call site can forget."""

    def format(self, record):
        return safe_text(super().format(record))


def size_text(size):
    """A file's size as the report and the export's summary line show it: '4.91 MB', '228 KB'."""
    return f"{size / 1e6:.2f} MB" if size >= 1e6 else f"{size / 1e3:.0f} KB"
