"""The run directory and its manifest: what each stage did, with which config, from which inputs.

    <run>/config.yaml      the resolved config: each stage's keys as that stage last ran them
    <run>/manifest.json    per stage: status, config hash, input/output sha256, metrics, timings, versions
    <run>/<stage>/...      the stage's outputs; <stage>/last/ holds its resume checkpoint
    <run>/.lock            held by the one `compress run` using the folder (gone when it ends)
    <run>/cache/pixels/    the images decoded once (written while the first stage reads them: before the manifest)

Only rank 0 writes here, always atomically, never through a symbolic link, and only in a folder that is
empty, new, or already a compress run.
"""

import datetime
import errno
import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import stat

from compress.errors import InputError
from compress.fileio import atomic_write_json, atomic_write_text, is_utf8_name, read_json, strange_entries

MANIFEST_FORMAT = "compress-run/1"
STATUSES = ("running", "complete", "failed", "interrupted")
LOCK_NAME = ".lock"
RUN_FILES = ("config.yaml", "manifest.json", "log.txt", "report.md", "report.json", "report.png", LOCK_NAME)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# what a first run writes before its manifest: the pixel cache of its images (<role>-<16 hex digits> folders)
_PIXEL_CACHE = re.compile(r"^[a-z]+-[0-9a-f]{16}$")
# metrics whose names say they are numbers (the report and `show` format them as such): a number or null
_NUMERIC_METRIC = re.compile(r"(acc|loss|params|bytes|speedup|epochs|_p|points|per_s|drop|ratio|agreement|diff|"
                             r"within_tie|_right|images|seconds|timing|_weight|temperature|views)$")


class RunDir:
    def __init__(self, root):
        self.root = os.path.abspath(os.path.expanduser(root))

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def rel(self, path):
        return os.path.relpath(path, self.root)

    @property
    def manifest_path(self):
        return self.path("manifest.json")

    @property
    def config_path(self):
        return self.path("config.yaml")

    def resume_checkpoint(self, stage):
        return self.path(stage, "last", "checkpoint.safetensors")

    @property
    def pixel_cache(self):
        """The folder of the images decoded once (unless data.cache_dir names another)."""
        return self.path("cache", "pixels")

    def exists(self):
        return os.path.isfile(self.manifest_path)

    def check_usable(self, writing=True):
        """Refuse, before anything is written, a folder that is not ours to write into: one holding other
        files (not a compress run), one with symbolic links inside, or (`writing`) one we cannot write to."""
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise InputError(f"run directory '{self.root}' is a file; choose a folder with --run-dir")
        if os.path.isdir(self.root):
            entries = [e for e in os.listdir(self.root) if e != LOCK_NAME]
            if entries and not os.path.lexists(self.manifest_path) and not self._only_pixel_cache(entries):
                raise InputError(f"run directory '{self.root}' is not empty and is not a compress run (no "
                                 "manifest.json); choose an empty or new folder with --run-dir")
            strange = strange_entries(self.root)
            if strange and strange[0][1] == "a symbolic link":
                raise InputError(f"run directory '{self.root}' contains a symbolic link ({strange[0][0]}); compress "
                                 "does not write through links - replace it with a real file or folder")
            if strange:  # a pipe would block the read or the write (`compress show` too), a device worse
                rel, kind = strange[0]
                raise InputError(f"run directory '{self.root}' contains {kind}, {rel}, where compress keeps only files "
                                 "and folders; remove it and rerun")
            self.check_files(RUN_FILES)
        if writing:
            self.check_writable()

    def _only_pixel_cache(self, entries):
        """Whether the folder holds nothing but the pixel cache a first run built before it stopped (a bad image,
        Ctrl-C or kill while decoding): ours to go on with, not someone else's folder."""
        folder = self.pixel_cache
        parent = os.path.dirname(folder)
        if entries != [os.path.basename(parent)] or os.path.islink(parent) or os.listdir(parent) != [
                os.path.basename(folder)]:
            return False
        return not os.path.islink(folder) and all(
            _PIXEL_CACHE.match(name) and os.path.isdir(os.path.join(folder, name)) for name in os.listdir(folder))

    def check_files(self, rels):
        """Refuse a folder where one of the run-relative files `rels` goes (compress would fail to write it after
        the work that makes it)."""
        for rel in rels:
            if os.path.isdir(self.path(rel)):
                raise InputError(f"run directory '{self.root}' has a folder where its file {rel} goes; move the folder "
                                 "away and rerun")

    def check_writable(self):
        if not is_utf8_name(self.root):
            raise InputError(f"run directory '{self.root}' has a name that is not UTF-8 text, which the libraries "
                             "writing into it refuse; choose a UTF-8 name with --run-dir")
        parent = self.root
        while not os.path.isdir(parent):  # the nearest existing ancestor is what must be writable
            up = os.path.dirname(parent)
            if up == parent or os.path.lexists(parent):  # a file where a folder must be
                raise InputError(f"cannot write to run directory '{self.root}' ('{parent}' is not a folder); "
                                 "choose another with --run-dir")
            parent = up
        if not os.access(parent, os.W_OK | os.X_OK):
            raise InputError(f"cannot write to run directory '{self.root}' (no write permission in '{parent}'); "
                             "choose another with --run-dir")

    def create(self):
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot write to run directory '{self.root}' ({e.strerror or e}); "
                             "choose another with --run-dir") from None

    def write_config(self, text):
        atomic_write_text(self.config_path, text)

    # ------------------------------------------------------------ manifest

    def manifest(self):
        path = self.manifest_path
        if not os.path.lexists(path):
            return {"format": MANIFEST_FORMAT, "stages": {}}
        data = read_json(path, "manifest")
        if not (isinstance(data, dict) and str(data.get("format", "")).startswith("compress")):
            raise InputError(f"'{self.root}' is not a compress run directory (its manifest.json is another "
                             "program's); choose an empty or new folder with --run-dir")
        problem = manifest_problem(data)
        if problem:
            raise InputError(f"manifest '{path}' is not a compress manifest ({problem}); restore it, or move it "
                             "away to rerun every stage from scratch")
        return data

    def stage_entry(self, stage):
        return self.manifest()["stages"].get(stage)

    def update_stage(self, stage, **fields):
        data = self.manifest()
        entry = data["stages"].setdefault(stage, {})
        entry.update(fields)
        atomic_write_json(self.manifest_path, data)
        return entry


def manifest_problem(data):
    """What makes `data` not a manifest compress can act on, or None. Every field compress reads is checked,
    so a hand-edited manifest gives one clear line, never a KeyError halfway through a run."""
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        return f"no \"format\": \"{MANIFEST_FORMAT}\""
    stages = data.get("stages")
    if not isinstance(stages, dict):
        return "\"stages\" is not a mapping"
    for name, entry in stages.items():
        if not isinstance(entry, dict) or entry.get("status") not in STATUSES:
            return f"stage '{name}' has no valid status"
        for key in ("inputs", "outputs"):
            files = entry.get(key, {})
            if not isinstance(files, dict) or not all(
                    isinstance(rel, str) and isinstance(sha, str) and _SHA256.match(sha) for rel, sha in files.items()):
                return f"stage '{name}' has malformed {key} (expected run-relative path -> sha256)"
            if any(os.path.isabs(rel) or ".." in rel.split("/") for rel in files if not rel.startswith("external:")):
                return f"stage '{name}' names a file outside the run directory in its {key}"
        for key, types in (("config_hash", str), ("result_hash", str), ("config", dict), ("metrics", dict),
                           ("seconds", (int, float)), ("world_size", int), ("message", str)):
            if entry.get(key) is not None and (not isinstance(entry[key], types) or isinstance(entry[key], bool)):
                return f"stage '{name}' has a malformed \"{key}\""
        seconds, world = entry.get("seconds"), entry.get("world_size")
        if seconds is not None and not 0 <= seconds < math.inf:
            return f"stage '{name}' has \"seconds\" {seconds}, which no run takes"
        if world is not None and world < 1:
            return f"stage '{name}' has \"world_size\" {world}, where a run has at least 1 process"
        if entry.get("status") == "complete" and not isinstance(entry.get("metrics"), dict):
            return f"stage '{name}' is complete but has no metrics"
        for key, value in (entry.get("metrics") or {}).items():
            if _NUMERIC_METRIC.search(str(key)) and value is not None and (
                    not isinstance(value, (int, float)) or isinstance(value, bool)):
                return f"stage '{name}' has a metric \"{key}\" that is not a number ({type(value).__name__})"
    return None


def file_check(run, rel, sha):
    """'ok', 'missing', 'not a file' (a folder, pipe, device or link in its place) or 'modified' for a file the
    manifest recorded."""
    from compress.fileio import sha256_file

    path = run.path(rel)
    if not os.path.lexists(path):
        return "missing"
    if not os.path.isfile(path) or os.path.islink(path):
        return "not a file"
    try:
        return "ok" if sha256_file(path) == sha else "modified"
    except InputError:
        return "modified"


# ---------------------------------------------------------------- lock


class RunLock:
    """An advisory lock on a run directory: one `compress run` at a time.

    The lock is an flock on `<run>/.lock`, so it is released by the kernel when its holder exits, however it
    exits (kill -9 included); the file also names the holder (pid, host) for the error message. Where the
    filesystem has no flock, the file alone is the lock, and a lock left by a dead process on this host is
    taken over."""

    def __init__(self, run):
        self.path = run.path(LOCK_NAME)
        self.fd = None

    def _open(self):
        if os.path.isdir(self.path) and not os.path.islink(self.path):
            raise InputError(f"run directory '{os.path.dirname(self.path)}' has a folder where its file {LOCK_NAME} "
                             "goes; move the folder away and rerun")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:  # a read-only mount (root passes every permission check), .lock not a file
            raise InputError(f"cannot write to run directory '{os.path.dirname(self.path)}' ({e.strerror}: "
                             f"{self.path}); use another run directory, or make it writable - `compress show` and "
                             "`compress predict` only read it") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a pipe: flock and the holder's note need a file
            os.close(fd)
            raise InputError(f"the run directory's lock file {self.path} is not a regular file (a pipe or device); "
                             "remove it and rerun")
        os.set_blocking(fd, True)
        return fd

    def acquire(self):
        import fcntl

        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise InputError(f"another compress run ({_describe(holder)}) is using "
                                     f"{os.path.dirname(self.path)}; wait for it to finish or use another "
                                     "--run-dir") from None
                if not self._stale_or_free(holder):  # no flock here (e.g. some network filesystems)
                    raise InputError(f"another compress run ({_describe(holder)}) is using "
                                     f"{os.path.dirname(self.path)}; wait for it or use another --run-dir") from None
                fd = self._open()
            # the file may have been removed and recreated by a releasing holder between open and flock:
            # only the lock on the file that is still at `path` counts
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": now()}).encode())
        self.fd = fd
        return self

    @staticmethod
    def _stale_or_free(holder):
        if not holder or holder.get("host") != socket.gethostname():
            return not holder
        try:
            os.kill(int(holder["pid"]), 0)
        except (ProcessLookupError, ValueError, TypeError):
            return True
        except PermissionError:
            return False
        return False

    def release(self):
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def lock_holder(run):
    """'pid N on host H' while another process holds `run`'s lock, else '' - creating nothing. Not for a process
    that holds the lock itself (its own lock would be reported), nor for `--nproc-per-node` workers, whose
    launcher holds it for them."""
    import fcntl

    try:  # O_NONBLOCK: a pipe planted as .lock would block a plain open until a writer came
        fd = os.open(run.path(LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # nobody's lock: `compress run` refuses it
            return ""
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return _describe(_read_holder(fd)) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else ""
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return ""
    finally:
        os.close(fd)


def _read_holder(fd):
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096).decode() or "null")
    except (OSError, ValueError):
        return None


def _describe(holder):
    if not isinstance(holder, dict):
        return "holder unknown"
    return f"pid {holder.get('pid')} on host {holder.get('host')}"


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions():
    """The versions of the packages a run depends on, read from the installed distributions' metadata: importing
    them to ask would cost every stage torchvision's import (~2 s, it pulls in torch._dynamo)."""
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name, distributions in (("torchvision", ("torchvision",)), ("onnx", ("onnx",)),
                                ("onnxruntime", ("onnxruntime", "onnxruntime-gpu")), ("safetensors", ("safetensors",))):
        for distribution in distributions:
            try:
                found[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    from compress import __version__
    found["compress"] = __version__
    return found
