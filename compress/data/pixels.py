"""Images decoded once, at the size training needs, and held as uint8 pixels for every stage and later run.

An image file is decoded and resized once; epochs, stages and later runs read the pixels back instead of
decoding the file again (FFCV's `max_resolution` files, in the same spirit). What is kept depends on what the
images are for:

    evaluation (validation, calibration)   the deployment rule exactly: shorter side to image_size / eval_crop,
                                           centre crop (`compress.deploy.imageio`, the rule in the ONNX metadata)
    training with random_resized_crop      the whole image, its shorter side shrunk to `train_side(...)` (never
                                           enlarged); the crops are cut from these pixels every epoch
    training with pad_crop or none         the deployment rule, as evaluation

Where the pixels live: in a run, on disk in `<run>/cache/pixels/<role>-<key>/` (or under `data.cache_dir`), in
chunks of IMAGES_PER_CHUNK images (fewer where images are large: about CHUNK_BYTES a chunk), each a safetensors file
(a flat uint8 tensor and the images' shapes); `pixels.json` records each chunk's sha256 as the chunk is written, and
every open checks each chunk against it, so a damaged or altered chunk - or one pixels.json does not record - is
decoded again, never used. The key is the images (a fingerprint of the files: names, sizes, bytes) and the rule, so
every stage of a run and every later run with the same images and sizes finds them. They are then read into memory
when they fit `data.cache_mb`, else memory-mapped (the operating system's page cache holds what fits). All ranks
decode chunks in parallel (round-robin, a thread per CPU); rank 0 writes them. Outside a run (the library called
directly) they are decoded into memory when they fit.
"""

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from compress.deploy import imageio
from compress.errors import InputError

log = logging.getLogger(__name__)

FORMAT = "compress-pixels/1"
IMAGES_PER_CHUNK = 512
CHUNK_BYTES = 128 * 2**20  # a chunk's pixels, at most about: building one holds three copies of it at once
KEEP_SIDE_FACTOR = 4  # random_resized_crop: images kept whole up to a shorter side of image_size x this


def train_side(image_size, eval_side):
    """The shorter side the training images are kept at for random_resized_crop: the whole image, shrunk only
    beyond KEEP_SIDE_FACTOR x image_size (files smaller than that are kept as they are, never enlarged), never
    less than the evaluation side. Measured on the photos recipe's teacher at 64 px, 10 epochs, 3 seeds
    (BENCHMARKS.md "Decoding images once"): kept at 1.25 x image_size it ended 2.8 points below cropping from the
    224 px originals (3.5 x), at 1.7 x (no crop of data.crop_scale's 0.35 enlarged) still 1.6 points below."""
    return max(eval_side, image_size * KEEP_SIDE_FACTOR)


def keep_aspect(side):
    """The resize rule of training images kept whole: shorter side shrunk to `side`, no crop."""
    return {"shorter_side": side, "height": None, "width": None, "interpolation": "bilinear", "antialias": True,
            "crop": "none"}


def decode(path, channels, rule):
    """uint8 (C, H, W) pixels of one image file under `rule` (an eval rule, or `keep_aspect`); InputError
    naming the file when it cannot be read."""
    if rule.get("height") is not None:
        return read_image(path, channels, rule).numpy()
    pixels = imageio.load_shrunk(path, channels, rule["shorter_side"])
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


@dataclasses.dataclass(frozen=True)
class PixelSpec:
    """What decides the cached pixels; its hash is the cache's key."""

    images: str  # the files' fingerprint (names below their common folder, sizes, bytes)
    count: int
    channels: int
    rule: dict
    images_per_chunk: int = IMAGES_PER_CHUNK

    @property
    def key(self):
        return hashlib.sha256(json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, sort_keys=True)
                              .encode()).hexdigest()[:16]

    @property
    def chunks(self):
        return -(-self.count // self.images_per_chunk)

    def chunk_range(self, c):
        return range(c * self.images_per_chunk, min((c + 1) * self.images_per_chunk, self.count))


class Pixels:
    """Decoded images, one flat uint8 array per chunk and each image's shape: `pixels[i]` is a (C, H, W) uint8
    tensor. The arrays are in memory, or memory-mapped from the cache's files."""

    def __init__(self, chunks, per_chunk, mapped=False):
        self.per_chunk, self.mapped = per_chunk, mapped
        self.flat, self.shapes, self.offsets = [], [], []
        for flat, shapes in chunks:
            shapes = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
            self.flat.append(flat)
            self.shapes.append(shapes)
            self.offsets.append(np.concatenate([[0], np.cumsum(shapes.prod(axis=1))]))
        self.count = sum(len(s) for s in self.shapes)

    def __len__(self):
        return self.count

    @property
    def nbytes(self):
        return int(sum(int(o[-1]) for o in self.offsets))

    def __getitem__(self, i):
        c, j = divmod(int(i), self.per_chunk)
        start, end = self.offsets[c][j], self.offsets[c][j + 1]
        part = self.flat[c][start:end]
        array = np.array(part) if self.mapped else part  # a memory map is read-only: copy the one image
        return torch.from_numpy(array).view(*(int(s) for s in self.shapes[c][j]))


def decode_chunk(files, channels, rule, threads):
    """(flat uint8 array, (n, 3) shapes, [(path, error)]) for these files, decoded by `threads` threads
    (Pillow releases the GIL while it decodes and resizes)."""
    def one(path):
        try:
            return decode(path, channels, rule), None
        except InputError as e:
            return None, (path, str(e))

    with ThreadPoolExecutor(max(1, threads)) as pool:
        results = list(pool.map(one, files))
    bad = [error for _, error in results if error is not None]
    arrays = [a for a, _ in results if a is not None]
    shapes = np.array([a.shape for a in arrays], dtype=np.int32).reshape(-1, 3)
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, dtype=np.uint8)
    return flat, shapes, bad


def images_per_chunk(files, channels, rule):
    """IMAGES_PER_CHUNK, or fewer where the images are large enough that a chunk would pass CHUNK_BYTES (a
    chunk is decoded, written and checked whole: 512 twelve-megapixel photos kept at 896 px would be 1.6 GB)."""
    per_image = estimate_bytes(files, channels, rule) / max(1, len(files))
    return int(min(IMAGES_PER_CHUNK, max(1, CHUNK_BYTES // max(1, per_image))))


def estimate_bytes(files, channels, rule, samples=200):
    """The decoded size of `files` under `rule`, from the headers of up to `samples` evenly spaced files
    (no pixel is decoded): exact for an eval rule, an estimate for shrunk images of varied shapes."""
    if rule.get("height") is not None:
        return len(files) * channels * rule["height"] * rule["width"]
    step = max(1, len(files) // samples)
    sizes = []
    for path in files[::step]:
        try:
            w, h = imageio.open_image(path, decode=False).size
        except InputError:
            continue
        side = rule["shorter_side"]
        scale = min(1.0, side / max(1, min(w, h)))
        sizes.append(channels * max(1, round(w * scale)) * max(1, round(h * scale)))
    return int(len(files) * (sum(sizes) / len(sizes))) if sizes else 0


class PixelCache:
    """One cache folder: `prepare(env)` finds what is there and whether it can be used (each chunk checked
    against the sha256 `pixels.json` recorded), `build(...)` decodes what is missing, `open(budget)` reads it."""

    def __init__(self, folder, spec):
        self.folder, self.spec = folder, spec

    @property
    def index_path(self):
        return os.path.join(self.folder, "pixels.json")

    def chunk_path(self, c):
        return os.path.join(self.folder, f"chunk-{c:06d}.safetensors")

    def prepare(self, env):
        """{"missing": [chunk ids], "status": reuse | resume | build | rebuild, "reason": words}, the same on
        every rank."""
        from compress.training import distributed as dist

        head = dist.on_main(env, self._read_head)
        present = head["present"]
        flags = torch.zeros(self.spec.chunks, dtype=torch.long)
        for c in present[env.rank::env.world]:
            if not self._chunk_ok(c, head["digests"].get(os.path.basename(self.chunk_path(c)))):
                flags[c] = 1
        flags = dist.all_reduce(env, flags, op="max")
        damaged = [c for c in range(self.spec.chunks) if flags[c]]
        missing = [c for c in range(self.spec.chunks) if c not in present or c in damaged]
        if damaged:
            name = os.path.basename(self.chunk_path(damaged[0]))
            return {"missing": missing, "status": "rebuild",
                    "reason": f"{len(damaged)} damaged chunk(s) ({name}, ...) decoded again"}
        if not missing:
            return {"missing": [], "status": "reuse", "reason": "images and sizes unchanged"}
        if len(missing) < self.spec.chunks:
            return {"missing": missing, "status": "resume",
                    "reason": f"{self.spec.chunks - len(missing)} of {self.spec.chunks} chunks already decoded"}
        return {"missing": missing, "status": "build", "reason": "not decoded yet"}

    def _read_head(self):
        """(Rank 0) the chunk files present and the digests pixels.json recorded for them."""
        if os.path.lexists(self.folder) and not os.path.isdir(self.folder):
            raise InputError(f"data: '{self.folder}' is a file where compress keeps decoded images; remove it (no "
                             "cache of compress's is a file)")
        present = [c for c in range(self.spec.chunks) if os.path.isfile(self.chunk_path(c))]
        digests = {}
        if os.path.isfile(self.index_path):
            from compress.fileio import read_json

            try:
                index = read_json(self.index_path, "pixel cache index")
            except InputError:
                index = None
            if isinstance(index, dict) and index.get("key") == self.spec.key and isinstance(index.get("chunks"), dict):
                digests = {k: v for k, v in index["chunks"].items() if isinstance(v, str)}
        return {"present": present, "digests": digests}

    def _chunk_ok(self, c, digest):
        """The chunk is whole and ours: its file's sha256 is the one pixels.json recorded when it was written, its
        header names this cache and chunk, its tensors hash to what the header says, and its shapes are ones the
        spec gives (`_shapes_ok`)."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        from compress.training.checkpoint import tensor_sha256

        try:
            with open(self.chunk_path(c), "rb") as f:
                data = f.read()
            if digest is None or hashlib.sha256(data).hexdigest() != digest:
                return False
            tensors = load(data)
            meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
            sums = json.loads(meta.get("sha256", "{}"))
        except (OSError, ValueError, SafetensorError, RuntimeError):
            return False
        if meta.get("cache") != self.spec.key or meta.get("chunk") != str(c) or not isinstance(sums, dict) \
                or set(sums) != {"pixels", "shapes"}:
            return False
        return (all(tensor_sha256(t) == sums[k] for k, t in tensors.items())
                and self._shapes_ok(c, tensors["shapes"], tensors["pixels"]))

    def _shapes_ok(self, c, shapes, flat):
        """Chunk c's tensors are what `decode_chunk` makes under the spec: one flat uint8 tensor, and an int32
        (C, H, W) for each of the chunk's images with C the cache's channels and H, W positive - the rule's
        height and width, or (an image kept whole) a shorter side of at most the rule's - whose sizes add up
        to every byte of the pixels (an image's bytes are where the shapes before it end)."""
        rule = self.spec.rule
        if flat.dtype != torch.uint8 or flat.dim() != 1 or shapes.dtype != torch.int32 or \
                tuple(shapes.shape) != (len(self.spec.chunk_range(c)), 3):
            return False
        shapes = shapes.long()
        if not (bool((shapes[:, 0] == self.spec.channels).all()) and bool((shapes[:, 1:] >= 1).all())):
            return False
        if rule.get("height") is not None:
            sized = bool((shapes[:, 1] == rule["height"]).all()) and bool((shapes[:, 2] == rule["width"]).all())
        else:
            sized = bool((shapes[:, 1:].min(1).values <= rule["shorter_side"]).all())
        return sized and int(shapes.prod(1).sum()) == flat.numel()  # one side bounded: no product overflows

    def check_disk(self, missing, files, rule):
        need = estimate_bytes(files, self.spec.channels, rule) * len(missing) // max(1, self.spec.chunks)
        folder = self.folder
        while not os.path.isdir(folder):
            folder = os.path.dirname(folder)
        free = shutil.disk_usage(folder).free
        return need, free

    def build(self, files, rule, env, missing):
        """Decode the missing chunks (ranks round-robin, a thread per CPU each), rank 0 writing each; then
        pixels.json. Every unreadable file of the set is named in one error, after the build."""
        from compress.training import distributed as dist
        from compress.training import interrupt

        recorded = {}
        if env.is_main:
            os.makedirs(self.folder, exist_ok=True)
            recorded = self._read_head()["digests"]  # the chunks kept from an interrupted build
        dist.barrier(env)
        bad, threads = [], max(1, torch.get_num_threads())
        for first in range(0, len(missing), env.world):
            mine = missing[first + env.rank] if first + env.rank < len(missing) else None
            decoded = None
            if mine is not None and not interrupt.local_request():
                decoded = (mine, *decode_chunk([files[i] for i in self.spec.chunk_range(mine)], self.spec.channels,
                                               rule, threads))
            interrupt.stop_if_asked("while decoding the images (the chunks written so far are kept)", env,
                                    what="resume decoding them")
            if env.distributed:  # each rank's chunk goes to rank 0, the one that writes
                payload = _pack(*decoded) if decoded else b""
                decoded = None
                gathered = [_unpack(data) for data in dist.gather_bytes(env, payload) if data]
            else:
                gathered = [decoded] if decoded else []
            for c, flat, shapes, errors in gathered:
                bad += errors
                if not errors:
                    recorded[os.path.basename(self.chunk_path(c))] = self._write_chunk(c, flat, shapes)
            del gathered
            if env.is_main:  # after every round: no chunk is ever on disk without its digest recorded
                self._write_index(recorded, complete=False)
        bad = [tuple(e) for e in dist.broadcast_json(env, bad)]  # every rank raises the error together
        if bad:
            raise UnreadableImages(sorted(bad), len(files))
        if env.is_main:
            self._write_index(recorded, complete=True)
        dist.barrier(env)

    def _write_chunk(self, c, flat, shapes):
        """Write chunk c; its file's sha256."""
        from compress.fileio import atomic_write_bytes
        from compress.training.checkpoint import serialize, tensor_sha256

        tensors = {"pixels": torch.from_numpy(flat), "shapes": torch.from_numpy(shapes)}
        meta = {"format": FORMAT, "cache": self.spec.key, "chunk": str(c),
                "sha256": json.dumps({k: tensor_sha256(v) for k, v in tensors.items()}, sort_keys=True)}
        data = serialize(tensors, meta)
        atomic_write_bytes(self.chunk_path(c), data)
        return hashlib.sha256(data).hexdigest()

    def _write_index(self, chunks, complete):
        from compress.fileio import atomic_write_json

        size = sum(os.path.getsize(self.chunk_path(c)) for c in range(self.spec.chunks)) if complete else None
        atomic_write_json(self.index_path, {"format": FORMAT, "key": self.spec.key, "complete": complete,
                                            "spec": dataclasses.asdict(self.spec),
                                            "chunks": dict(sorted(chunks.items())), "bytes": size})

    def open(self, budget):
        """The cached pixels: read into memory when they fit `budget` bytes, else memory-mapped."""
        from compress.training.checkpoint import memory_map_safetensors

        maps = [memory_map_safetensors(self.chunk_path(c)) for c in range(self.spec.chunks)]
        total = sum(m["pixels"].nbytes for m in maps)
        in_memory = total <= budget
        chunks = [(np.array(m["pixels"]) if in_memory else m["pixels"], np.array(m["shapes"])) for m in maps]
        return Pixels(chunks, self.spec.images_per_chunk, mapped=not in_memory)


def _pack(c, flat, shapes, errors):
    """One decoded chunk as bytes to gather: a JSON header line (chunk, shapes, errors), then the pixels."""
    head = json.dumps({"chunk": c, "shapes": shapes.tolist(), "errors": errors}).encode()
    return len(head).to_bytes(8, "little") + head + flat.tobytes()


def _unpack(data):
    size = int.from_bytes(data[:8], "little")
    head = json.loads(data[8:8 + size])
    flat = np.frombuffer(data, dtype=np.uint8, offset=8 + size).copy()
    shapes = np.array(head["shapes"], dtype=np.int32).reshape(-1, 3)
    return head["chunk"], flat, shapes, [tuple(e) for e in head["errors"]]


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a run keeps decoded images: its cache folder, and the process group that decodes them."""

    folder: str
    env: object
    in_run_dir: bool = True  # a folder of the run's own (stale caches of a role are pruned there)
    shown_from: str = ""  # paths in the log are relative to this folder (the run directory)


def _side_text(rule):
    """How `rule` sizes the images, for the log: 'at shorter side 73', or 'whole up to shorter side 256'."""
    kept = "whole up to shorter side" if rule.get("crop") == "none" else "at shorter side"
    return f"{kept} {rule['shorter_side']}"


def hold(files, channels, rule, budget, place=None, role="train", fingerprint=None):
    """The decoded images of `files` under `rule` as Pixels, and how they are held in words (for the log);
    (None, words) when they are decoded every batch instead (no cache folder and more than `budget` bytes)."""
    count = len(files)
    if place is None:
        need = estimate_bytes(files, channels, rule)
        if need > budget:
            return None, (f"{count:,} {role} images decoded every batch: decoded once {_side_text(rule)} "
                          f"they need ~{need / 2**20:,.0f} MB, over data.cache_mb "
                          f"({budget / 2**20:,.0f}); raise data.cache_mb to {math.ceil(need / 2**20 * 1.1):,}")
        start = time.perf_counter()
        flat, shapes, bad = decode_chunk(files, channels, rule, max(1, torch.get_num_threads()))
        if bad:
            raise UnreadableImages(bad, count)
        pixels = Pixels([(flat, shapes)], max(1, count))
        return pixels, (f"{count:,} {role} images decoded once into memory {_side_text(rule)} "
                        f"({pixels.nbytes / 2**20:,.0f} MB, {time.perf_counter() - start:.1f}s)")
    spec = PixelSpec(fingerprint, count, channels, rule, images_per_chunk(files, channels, rule))
    cache = PixelCache(os.path.join(place.folder, f"{role}-{spec.key}"), spec)
    plan = cache.prepare(place.env)
    start = time.perf_counter()
    if plan["missing"]:
        need, free = cache.check_disk(plan["missing"], files, rule)
        if need > free * 0.95:
            raise InputError(f"data: decoding the {role} images once needs ~{need / 1e9:.2f} GB in {place.folder} "
                             f"but it has {free / 1e9:.2f} GB free; free some space or set data.cache_dir to a "
                             "folder on a disk with room")
        if place.env.is_main and place.in_run_dir:
            _prune(place.folder, role, spec.key)
        cache.build(files, rule, place.env, plan["missing"])
    _seen_by_every_process(cache, place.env)
    pixels = cache.open(budget)
    took = time.perf_counter() - start
    where = "memory-mapped from" if pixels.mapped else "in memory, from"
    done = {"reuse": "reused", "build": f"decoded in {took:.1f}s", "resume": f"rest decoded in {took:.1f}s",
            "rebuild": f"{plan['reason']} in {took:.1f}s"}[plan["status"]]
    return pixels, (f"{count:,} {role} images {_side_text(rule)}, {pixels.nbytes / 2**20:,.0f} MB "
                    f"{where} {os.path.relpath(cache.folder, place.shown_from) if place.shown_from else cache.folder} "
                    f"({done})")


def _seen_by_every_process(cache, env):
    """Every process reads the chunks rank 0 wrote: a cache folder that is another folder on another node (a
    data.cache_dir on a node's own disk, or relative to each launcher's working directory) is refused in one
    sentence here, not found missing by a worker in the middle of training."""
    if not env.distributed:
        return
    from compress.training import distributed as dist

    whole = os.path.isfile(cache.index_path) and all(os.path.isfile(cache.chunk_path(c))
                                                      for c in range(cache.spec.chunks))
    blind = dist.all_reduce(env, torch.tensor([0 if whole else 1], dtype=torch.long), op="max")
    if int(blind[0]):
        dist.raise_on_main(env, InputError(
            f"data: the pixel cache {cache.folder} that rank 0 wrote is not there for every process (a folder on "
            "one node's own disk?); set data.cache_dir to an absolute path every node sees, or leave it unset "
            "to keep the cache in the run directory"))


def _prune(folder, role, key):
    """Remove this role's caches of other images or sizes from the run's cache folder (its config changed)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name.startswith(f"{role}-") and name != f"{role}-{key}":
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


SHOWN = 20  # unreadable files named in one error: every one, for the few a folder usually has


class UnreadableImages(InputError):
    """Files of a set that cannot be decoded ([(path, error)] of `total`), raised by every process alike (the
    list is the same on each); `raise_unreadable` lets rank 0 alone say it, for every set of a dataset at once."""

    def __init__(self, bad, total):
        super().__init__(unreadable_sentence(bad, total))
        self.bad, self.total = list(bad), total


def raise_unreadable(errors, place):
    """Raise the UnreadableImages `errors` (one per set: training, validation) as one, naming every file; in a
    process group (`place.env`) rank 0 says it and the others exit with it quietly."""
    if not errors:
        return
    error = UnreadableImages(sorted(b for e in errors for b in e.bad), sum(e.total for e in errors))
    if place is not None:
        from compress.training import distributed as dist

        dist.raise_on_main(place.env, error)
    raise error


def unreadable_sentence(bad, total):
    """One sentence for [(path, its error)] of `total` files: the first error in full, then how many more and
    which (the first few), so one run names every file to fix, not one per run."""
    first = bad[0][1]
    if len(bad) == 1:
        return first
    shown = ", ".join(f"'{p}'" for p, _ in bad[1:SHOWN])  # enough for the bad files a folder usually has
    more = f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
    return f"{first}; {len(bad) - 1} more of the {total:,} files cannot be read either: {shown}{more}"


def read_image(path, channels, rule=None):
    """uint8 (C, H, W) pixels of an image file (16-bit and float images scaled, not clipped), resized and
    centre-cropped by `rule`, or at the file's own size when `rule` is None."""
    import numpy as np

    if rule is not None:
        pixels = imageio.load_pixels(path, channels, rule)
    else:
        converted, _ = imageio.to_channels(imageio.open_image(path), channels, path)
        if isinstance(converted, list):
            pixels = np.stack([np.asarray(p, dtype=np.float32) for p in converted], axis=-1)
        else:
            pixels = np.asarray(converted, dtype=np.uint8)
            pixels = pixels[..., None] if pixels.ndim == 2 else pixels
    if pixels.dtype != np.uint8:
        pixels = np.clip(np.rint(pixels * 255.0), 0, 255).astype(np.uint8)
    return torch.from_numpy(np.array(pixels)).permute(2, 0, 1).contiguous()
