"""The teacher-output store: the frozen teacher's outputs for every (image, view), computed once, kept on disk
in the run directory (`distill/teacher_outputs/`), memory-mapped for reading, and reused by every later distill
run whose teacher, data and views are unchanged - another student, other loss weights, another training seed,
a rerun after a crash (which resumes the build where it stopped).

What is stored, per (image, view):
  - the teacher's logits in fp16: all of them when there are few classes (`distill.store.top_k: null` keeps
    all up to 100 classes), else the top k with their class indices and the log-sum-exp of the other logits.
    A loss gets a full logit vector back: the top k exact, and every other class one shared value chosen so
    that, at temperature 1, the mass outside the top k is exactly what the teacher gave it, spread evenly over
    those classes (so softmax(top-k logits) are the teacher's own probabilities). At other temperatures the
    rest stays evenly spread - what FKD (Shen & Xing, ECCV 2022) does with its stored soft labels.
  - with the cosine loss, the teacher layer's output reduced to the student's width, in fp16.
  - never the hint loss's feature maps (kilobytes per image): with a hint the teacher runs on every batch.

Layout: chunks of up to ROWS_PER_CHUNK rows, chunk c = (view c // blocks, samples of block c % blocks), each a
safetensors file whose metadata carries the store key and the sha256 of each of its tensors. `store.json` (the
key's fields, the views complete, and the sha256 of every chunk file written) is rewritten after each chunk, so
every chunk is checked against the digest recorded when it was built - a chunk rewritten with its own tensor
hashes updated is found and rebuilt as surely as a truncated one - and a chunk that store.json does not record
is not trusted. All ranks compute chunks in parallel (round-robin); rank 0 writes them (it alone writes in a run
directory), each atomically. Every rank reads
through memory maps of the same files: nothing is all-gathered, and the memory a process holds is a chunk
while building and the pages it touches while training (shared, file-backed page cache).
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import time

import numpy as np
import torch

from compress.errors import InputError
from compress.fileio import atomic_write_bytes, atomic_write_json, dumps, open_regular, read_json
from compress.training import distributed as dist
from compress.training import interrupt
from compress.training.checkpoint import memory_map_safetensors as _memory_map
from compress.training.checkpoint import serialize
from compress.training.checkpoint import tensor_sha256 as _sha256

log = logging.getLogger(__name__)

FORMAT = "compress-teacher-outputs/1"
ROWS_PER_CHUNK = 65536
MAX_VIEWS = 100_000  # distill.views' largest
DENSE_UP_TO = 100
DEFAULT_TOP_K = 10
BYTES, LAYOUT = 1, 2  # what is wrong with a damaged chunk, in the words the rebuild's reason gives
DAMAGE = {BYTES: "their bytes are not what store.json recorded when they were built",
          LAYOUT: "their tensors are not the names, shapes and dtypes this store holds"}


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """Everything that determines the stored values; its hash is the store's key."""

    teacher_sha256: str
    teacher_model: str
    data_fingerprint: str
    samples: int
    views: int
    classes: int
    top_k: int  # == classes: every logit is kept
    augment: dict  # the views' parameters (crop, flip, mixing, view seed)
    precision: str  # the autocast the teacher ran under
    cosine_layer: str = ""  # the stored feature loss's (feature_losses.STORED_FEATURE, the cosine loss) teacher layer
    cosine_width: int = 0  # and its width; 0: no features stored
    rows_per_chunk: int = ROWS_PER_CHUNK
    teacher_code: str = ""  # sha256 of the teacher's source file when it is the user's code (<module>:<function>):
    # the same weights under edited code give other outputs
    feature_copy: int = 0  # 1: stored features are the cosine layer's own output, copied before a later in-place op
    # could change it (`FeatureTap`); stores of features kept before that have no such field and are rebuilt

    def _keyed(self):
        """Everything but the number of views: view v is the same pixels whatever the count, so a store of V
        views serves any run of up to V views, and a run wanting more adds views to it. A registry or torchvision
        teacher has no code digest, and a store without features no feature_copy: each keeps the key it had before
        there was one."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k != "views" and not (k in ("teacher_code", "feature_copy") and not v)}

    @property
    def key(self):
        return hashlib.sha256(dumps(self._keyed()).encode()).hexdigest()[:16]

    @property
    def dense(self):
        return self.top_k >= self.classes

    @property
    def blocks(self):
        return -(-self.samples // self.rows_per_chunk)

    @property
    def chunks(self):
        return self.views * self.blocks

    @property
    def index_dtype(self):
        return torch.uint8 if self.classes <= 256 else torch.int16 if self.classes <= 32767 else torch.int32

    def bytes_per_row(self):
        """Bytes stored per (image, view): fp16 logits (top k + indices + the rest's log-sum-exp) and features."""
        if self.dense:
            logits = 2 * self.classes
        else:
            logits = 2 * self.top_k + self.top_k * torch.tensor([], dtype=self.index_dtype).element_size() + 4
        return logits + 2 * self.cosine_width

    def total_bytes(self):
        return self.bytes_per_row() * self.samples * self.views

    def chunk_rows(self, c):
        block = c % self.blocks
        return range(block * self.rows_per_chunk, min((block + 1) * self.rows_per_chunk, self.samples))

    def difference(self, old):
        """Why a store with the spec `old` (a dict) cannot serve this one, in words."""
        words = {"teacher_sha256": "the teacher changed", "teacher_model": "the teacher model changed",
                 "data_fingerprint": "the training images changed", "samples": "the number of images changed",
                 "views": "the number of views changed", "classes": "the number of classes changed",
                 "top_k": "distill.store.top_k changed", "augment": "the augmentation of the views changed",
                 "precision": "the teacher's precision changed", "cosine_layer": "the cosine layer changed",
                 "cosine_width": "the cosine width changed", "rows_per_chunk": "the chunk size changed",
                 "teacher_code": "the teacher's code changed",
                 "feature_copy": "its cosine features were kept before a later in-place layer could change them"}
        for name, value in self._keyed().items():
            if old.get(name) != value:
                return words.get(name, f"{name} changed")
        return "it is not a store of this format"


def default_top_k(classes, top_k=None):
    """distill.store.top_k: as given, or every logit up to DENSE_UP_TO classes, else DEFAULT_TOP_K."""
    if top_k is not None:
        return min(top_k, classes)
    return classes if classes <= DENSE_UP_TO else DEFAULT_TOP_K


FP16_MAX = float(torch.finfo(torch.float16).max)  # 65,504: a logit beyond it would be stored as inf


def to_fp16(x):
    """fp16 of finite float values, those beyond fp16's range clamped to its largest (not made inf)."""
    return x.float().clamp(-FP16_MAX, FP16_MAX).half()


def pack_logits(logits, spec):
    """{tensor name: tensor} for the rows of one chunk (float logits in, fp16 out)."""
    logits = logits.float()
    if spec.dense:
        return {"values": to_fp16(logits)}
    values, indices = logits.topk(spec.top_k, dim=1)
    rest = torch.logsumexp(logits.scatter(1, indices, float("-inf")), dim=1)
    return {"values": to_fp16(values), "indices": indices.to(spec.index_dtype), "rest": rest}


def unpack_logits(packed, spec):
    """Full float32 logits from packed rows: the top k exact, the other classes one shared value that gives
    them the teacher's remaining mass at T = 1, evenly (see the module docstring)."""
    values = packed["values"].float()
    if spec.dense:
        return values
    others = spec.classes - spec.top_k
    filler = packed["rest"].float() - math.log(others)
    full = filler[:, None].expand(len(values), spec.classes).clone()
    return full.scatter_(1, packed["indices"].long(), values)


class TeacherOutputStore:
    """One store folder. `prepare(env)` finds out what is there (reusable, to resume, to rebuild - and why);
    `build(...)` computes what is missing; `lookup(indices, views)` reads outputs back through memory maps."""

    def __init__(self, folder, spec):
        self.folder, self.spec = folder, spec
        self.maps = {}

    @property
    def manifest_path(self):
        return os.path.join(self.folder, "store.json")

    def chunk_name(self, c):
        return f"chunk-{c:06d}.safetensors"

    def chunk_path(self, c):
        return os.path.join(self.folder, self.chunk_name(c))

    # ------------------------------------------------------------------ what is there

    def prepare(self, env):
        """What this run must build, the same on every rank: {"status": reuse | resume | extend | build |
        rebuild, "reason": words, "missing": [chunk ids], "wipe": whether the folder's old store goes first,
        "views_kept": views the store will hold}. Every chunk this run needs is checked (each rank a share), so
        a damaged one is rebuilt, never used."""
        head = dist.on_main(env, self._read_head)
        keep = max(self.spec.views, head["views"])
        if head["stale"]:
            return {"status": "rebuild", "reason": head["stale"], "missing": list(range(self.spec.chunks)),
                    "wipe": True, "views_kept": self.spec.views, "views_complete": 0, "digests": {}}
        present = head["present"]
        damaged = self._check_chunks(env, present, head["digests"])
        broken = {c for c, _ in damaged}
        missing = [c for c in range(self.spec.chunks) if c not in present or c in broken]
        rebuilt = {self.chunk_name(c) for c in missing}
        plan = {"missing": missing, "wipe": False, "views_kept": keep,
                "views_complete": min(head["views"], min(missing, default=self.spec.chunks) // self.spec.blocks),
                "digests": {name: d for name, d in head["digests"].items() if name not in rebuilt}}
        if damaged:
            name = os.path.basename(self.chunk_path(damaged[0][0]))
            return {**plan, "status": "rebuild", "reason": f"{len(damaged)} damaged chunk(s) ({name}, ...) rebuilt: "
                                                           f"{DAMAGE[damaged[0][1]]}"}
        if not missing and head["views"] >= self.spec.views:
            return {**plan, "status": "reuse", "reason": "teacher, images and views unchanged"}
        if head["views"] and len(missing) == (self.spec.views - head["views"]) * self.spec.blocks:
            return {**plan, "status": "extend", "reason": f"it holds {head['views']} views; adding "
                                                          f"{self.spec.views - head['views']}"}
        if len(missing) < self.spec.chunks:
            return {**plan, "status": "resume", "reason": f"{self.spec.chunks - len(missing)} of {self.spec.chunks} "
                                                          "chunks already built"}
        return {**plan, "status": "build", "reason": "no store yet"}

    def _read_head(self):
        """(On rank 0) whether the folder holds a store of another key, or a store.json that cannot be one (and
        why), how many views its store.json says are complete, which of this run's chunk files it records (with
        the sha256 recorded for each) and are there."""
        if not os.path.isfile(self.manifest_path):  # no record of any chunk: none is trusted
            return {"stale": "", "present": [], "views": 0, "digests": {}}
        try:
            old = read_json(self.manifest_path, "teacher-output store manifest")
        except InputError:
            return {"stale": "its store.json is unreadable", "present": [], "views": 0, "digests": {}}
        if not isinstance(old, dict) or old.get("format") != FORMAT or old.get("key") != self.spec.key:
            spec = old.get("spec") if isinstance(old, dict) and isinstance(old.get("spec"), dict) else {}
            return {"stale": self.spec.difference(spec), "present": [], "views": 0, "digests": {}}
        views, chunks = old.get("views"), old.get("chunks")
        problem = self._manifest_problem(views, chunks)
        if problem:
            return {"stale": f"its store.json {problem}", "present": [], "views": 0, "digests": {}}
        present = [c for c in range(self.spec.chunks)
                   if self.chunk_name(c) in chunks and os.path.isfile(self.chunk_path(c))]
        return {"stale": "", "present": present, "views": views, "digests": chunks}

    def _manifest_problem(self, views, chunks):
        """What makes store.json's views and chunk digests impossible for this store ('' when nothing): views
        must be a count of views whose every chunk it records (a claim of 10^12 views is a damaged file, and
        would be a loop of 10^12 chunks), digests sha256 strings."""
        if not isinstance(views, int) or isinstance(views, bool) or views < 0 or not isinstance(chunks, dict):
            return "has no valid views and chunks"
        if views * self.spec.blocks > len(chunks) or views > MAX_VIEWS:
            return f"claims {views:,} complete views but records {len(chunks):,} chunk(s)"
        if not all(isinstance(v, str) and len(v) == 64 for v in chunks.values()):
            return "records a chunk digest that is not a sha256"
        if not all(self.chunk_name(c) in chunks for c in range(views * self.spec.blocks)):
            return f"claims {views:,} complete views without recording all their chunks"
        return ""

    def _check_chunks(self, env, present, digests):
        """[(chunk id, what is wrong with it: a key of DAMAGE)] of the chunks present that cannot be used."""
        flags = torch.zeros(self.spec.chunks, dtype=torch.long)
        for c in present[env.rank::env.world]:
            flags[c] = self._chunk_damage(c, digests[self.chunk_name(c)])
        flags = dist.all_reduce(env, flags, op="max")
        return [(c, int(flags[c])) for c in range(self.spec.chunks) if flags[c]]

    def _chunk_damage(self, c, digest):
        """0 when the chunk can be used, else what is wrong with it (a key of DAMAGE). Usable: the file's sha256
        is the one store.json recorded when it was built, the file is whole, of this store, every tensor's bytes
        hash to what its metadata says, its values are finite (an older build stored logits beyond fp16's range
        as inf), and its tensors are exactly the spec's (`_templates`: the names, one row per image of the
        chunk, each row's width, the dtypes) - what `lookup` reads them into."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            with os.fdopen(open_regular(self.chunk_path(c), "teacher-output chunk"), "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != digest:
                return BYTES
            tensors = load(data)
            meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
            sums = json.loads(meta.get("sha256", "{}"))
        except (OSError, ValueError, SafetensorError, RuntimeError, InputError):
            return BYTES
        if meta.get("store") != self.spec.key or meta.get("chunk") != str(c) or not isinstance(sums, dict) \
                or set(sums) != set(tensors):
            return BYTES
        if not all(_sha256(t) == sums[name] for name, t in tensors.items()):
            return BYTES
        rows, templates = len(self.spec.chunk_rows(c)), self._templates()
        if set(tensors) != set(templates) or any(
                t.dtype != templates[name].dtype or tuple(t.shape) != (rows, *templates[name].shape[1:])
                for name, t in tensors.items()):
            return LAYOUT
        if not all(not t.is_floating_point() or bool(torch.isfinite(t).all()) for t in tensors.values()):
            return BYTES
        return 0

    # ------------------------------------------------------------------ building

    def check_disk(self, missing):
        """One clear line, before any training, when the chunks still to build do not fit on the disk."""
        need = self.spec.bytes_per_row() * sum(len(self.spec.chunk_rows(c)) for c in missing)
        folder = self.folder
        while not os.path.isdir(folder):
            folder = os.path.dirname(folder)
        free = shutil.disk_usage(folder).free
        if need > free * 0.95:
            raise InputError(
                f"distill: the teacher-output store needs {need / 1e9:.2f} GB more ({self.spec.views} views x "
                f"{self.spec.samples:,} images x {self.spec.bytes_per_row()} bytes) but {folder} has "
                f"{free / 1e9:.2f} GB free; lower distill.views or distill.store.top_k, or set "
                "distill.store.enabled=false to run the teacher on every batch")

    def build(self, teacher, dataset, env, batch_size, inputs, plan, autocast=contextlib.nullcontext):
        """Compute the plan's missing chunks (ranks round-robin; rank 0 writes each), then store.json. The
        teacher runs under `autocast()` (the training's precision). A stop request (Ctrl-C) ends the build
        after the current batch; chunks already written stay and a rerun resumes."""
        missing = plan["missing"]
        # rank 0 records each chunk in store.json as it writes it: file name -> sha256, and the views complete
        self._record = {"digests": dict(plan["digests"]), "views": plan["views_complete"],
                        "start": time.perf_counter(), "world": env.world}
        if env.is_main:
            os.makedirs(self.folder, exist_ok=True)
            if plan["wipe"]:  # a store of another teacher, data or views: none of it can serve
                for name in os.listdir(self.folder):
                    if name == "store.json" or name.startswith("chunk-"):
                        os.unlink(os.path.join(self.folder, name))
        dist.barrier(env)
        start, peak = time.perf_counter(), 0.0
        for first in range(0, len(missing), env.world):
            mine = missing[first + env.rank] if first + env.rank < len(missing) else None
            stats = torch.zeros(2, dtype=torch.float64)  # images with a non-finite output, largest |output|
            packed = (self._compute(mine, teacher, dataset, batch_size, inputs, autocast, stats)
                      if mine is not None else None)
            interrupt.stop_if_asked("while computing the teacher's outputs (the chunks written so far are kept)",
                                    env, what="resume the build")
            every = dist.all_gather_tensor(env, stats)
            broken, peak = sum(int(t[0]) for t in every), max(peak, *(float(t[1]) for t in every))
            dist.fail_if(env, broken > 0, self._non_finite_message(broken))
            for c, tensors in self._gather(env, mine, packed):
                if env.is_main:
                    self._write_chunk(c, tensors)
        if env.is_main and peak > FP16_MAX:
            log.warning("distill: the teacher's outputs reach %.3g, beyond the store's fp16 range (%s): the store "
                        "keeps them clamped there. Logits this large mean an overconfident teacher that teaches "
                        "little beyond its top class; a teacher trained more gently (a lower teacher.lr, label "
                        "smoothing) makes a better one", peak, f"{FP16_MAX:,.0f}")
        if env.is_main:
            self._write_manifest(plan["views_kept"], self._record["digests"], time.perf_counter() - start, env.world)
        dist.barrier(env)

    def _non_finite_message(self, broken):
        where = f"distill: the teacher's outputs are not finite (NaN or inf) for {broken} training image(s)"
        if self.spec.precision == "fp16":  # autocast overflowed before the store saw the outputs
            return (f"{where} in fp16, the precision this run computes it in: its outputs overflow fp16's range - "
                    "set train.precision to fp32 (or bf16 where the hardware has it); the store is left unfinished")
        return (f"{where}: the teacher checkpoint is broken - retrain it (`compress run --stages teacher --force`, "
                "with a lower teacher.lr if its loss grew); the store is left unfinished")

    def _compute(self, c, teacher, dataset, batch_size, inputs, autocast, stats):
        """One chunk's packed teacher outputs; `stats` gets the images whose outputs are not finite, and the
        largest finite |output|."""
        view, rows = c // self.spec.blocks, list(self.spec.chunk_rows(c))
        parts = []
        for i in range(0, len(rows), batch_size):
            if interrupt.local_request():
                return None
            samples = rows[i:i + batch_size]
            with autocast():
                out = teacher(inputs(dataset.batch(samples, views=[view] * len(samples)).x))
            outputs = [out["logits"].float().cpu()] + ([out["cosine"].float().cpu()] if self.spec.cosine_width else [])
            whole = torch.ones(len(samples), dtype=torch.bool)  # images whose every output is finite
            for x in outputs:
                finite = torch.isfinite(x)
                whole &= finite.flatten(1).all(1)
                stats[1] = max(float(stats[1]), float(x[finite].abs().max()) if finite.any() else 0.0)
            stats[0] += int((~whole).sum())
            part = pack_logits(outputs[0], self.spec)
            if self.spec.cosine_width:
                part["cosine"] = to_fp16(outputs[1])
            parts.append(part)
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def _gather(self, env, c, packed):
        """[(chunk id, tensors)] of this round, on rank 0 (every rank's chunk, padded to the chunk size to
        all-gather, then cut back); [] elsewhere."""
        if not env.distributed:
            return [(c, packed)] if packed is not None else []
        rows = self.spec.rows_per_chunk
        ids = dist.all_gather_tensor(env, torch.tensor([c if packed is not None else -1]))
        out = [[] for _ in range(env.world)]
        for name, template in self._templates().items():
            mine = torch.zeros((rows, *template.shape[1:]), dtype=template.dtype)
            if packed is not None:
                mine[:len(packed[name])] = packed[name]
            for r, t in enumerate(dist.all_gather_tensor(env, mine)):
                out[r].append((name, t))
        gathered = []
        for r, cid in enumerate(int(t.item()) for t in ids):
            if cid >= 0:
                n = len(self.spec.chunk_rows(cid))
                gathered.append((cid, {name: t[:n] for name, t in out[r]}))
        return gathered

    def _templates(self):
        """One empty row of each tensor a chunk holds (its dtype and row shape)."""
        s = self.spec
        t = {"values": torch.zeros(1, s.classes if s.dense else s.top_k, dtype=torch.float16)}
        if not s.dense:
            t["indices"] = torch.zeros(1, s.top_k, dtype=s.index_dtype)
            t["rest"] = torch.zeros(1, dtype=torch.float32)
        if s.cosine_width:
            t["cosine"] = torch.zeros(1, s.cosine_width, dtype=torch.float16)
        return t

    def _write_chunk(self, c, tensors):
        """Write chunk `c`, then store.json recording its sha256 (a crash between the two leaves a chunk that
        store.json does not record: it is rebuilt, never trusted)."""
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        meta = {"format": FORMAT, "store": self.spec.key, "chunk": str(c),
                "sha256": json.dumps({k: _sha256(v) for k, v in tensors.items()}, sort_keys=True)}
        data = serialize(tensors, meta)
        atomic_write_bytes(self.chunk_path(c), data)
        r = self._record
        r["digests"][self.chunk_name(c)] = hashlib.sha256(data).hexdigest()
        self._write_manifest(r["views"], r["digests"], time.perf_counter() - r["start"], r["world"])

    def _write_manifest(self, views, chunks, seconds, world):
        """store.json: the key's fields, how many views are complete, the sha256 of every chunk file written
        (`chunks`: file name -> sha256; rewritten after each chunk, so none is ever on disk unrecorded)."""
        spec = dataclasses.replace(self.spec, views=views)
        chunks = dict(sorted(chunks.items()))
        atomic_write_json(self.manifest_path, {
            "format": FORMAT, "key": spec.key, "views": views, "spec": dataclasses.asdict(spec), "chunks": chunks,
            "bytes": spec.total_bytes(), "bytes_per_row": spec.bytes_per_row(),
            "last_build": {"seconds": round(seconds, 2), "processes": world}})

    # ------------------------------------------------------------------ reading

    def open(self):
        """Memory-map every chunk's tensors (no data is read until a lookup touches it)."""
        self.maps = {c: _memory_map(self.chunk_path(c)) for c in range(self.spec.chunks)}
        return self

    def lookup(self, indices, views, device):
        """{"logits": float32 (B, classes)[, "cosine": float32 (B, width)]} for samples `indices` in `views`."""
        indices = torch.as_tensor(indices).cpu().numpy().astype(np.int64)  # a batch on the GPU: its indices too
        views = torch.as_tensor(views).cpu().numpy().astype(np.int64)
        rows = indices % self.spec.rows_per_chunk
        chunk = views * self.spec.blocks + indices // self.spec.rows_per_chunk
        names = self._templates()
        packed = {name: torch.empty((len(indices), *t.shape[1:]), dtype=t.dtype) for name, t in names.items()}
        for c in np.unique(chunk):
            where = np.nonzero(chunk == c)[0]
            for name in names:
                packed[name][torch.from_numpy(where)] = torch.from_numpy(np.ascontiguousarray(
                    self.maps[int(c)][name][rows[where]]))
        out = {"logits": unpack_logits(packed, self.spec).to(device, non_blocking=True)}
        if "cosine" in packed:
            out["cosine"] = packed["cosine"].float().to(device, non_blocking=True)
        return out

    def describe(self, plan, seconds=None):
        s = self.spec
        info = {"mode": "stored", "status": plan["status"], "reason": plan["reason"], "key": s.key,
                "views": s.views, "samples": s.samples, "top_k": s.top_k, "dense": s.dense,
                "bytes_per_row": s.bytes_per_row(), "megabytes": round(s.total_bytes() / 1e6, 2),
                "chunks": s.chunks, "chunks_built": len(plan["missing"]), "views_kept": plan["views_kept"]}
        if seconds is not None:
            info["seconds"] = round(seconds, 2)
        return info


def why_not_stored(d):
    """Why the teacher runs on every batch instead of being read from the store ('' when it is stored), for the
    distill config `d`."""
    from compress.distill.feature_losses import FEATURE_LOSSES

    if not d.store.enabled:
        return "distill.store.enabled is false"
    unstored = [name for name, loss in FEATURE_LOSSES.items() if getattr(d, name).weight and not loss.stored]
    if unstored:
        return (f"the {unstored[0]} loss needs the teacher's feature maps, which the store does not keep (kilobytes "
                "per image)")
    if not (d.loss_weights()["kd"] or any(getattr(d, n).weight for n, loss in FEATURE_LOSSES.items() if loss.stored)):
        return NO_TEACHER_LOSS
    return ""


NO_TEACHER_LOSS = "no loss needs the teacher"


def plan_store(folder, env, d, teacher_sha256, teacher_model, teacher, train_set, classes, precision, teacher_code=""):
    """(store, plan) when the teacher's outputs are stored, else (None, why not). Checked before anything is
    written: a store that would not fit on the disk is refused here, with the numbers."""
    why = why_not_stored(d)
    if why:
        return None, why
    a = train_set.augment
    spec = StoreSpec(
        teacher_sha256=teacher_sha256, teacher_model=teacher_model, data_fingerprint=train_set.fingerprint(),
        samples=len(train_set), views=a.views, classes=classes, top_k=default_top_k(classes, d.store.top_k),
        augment={"kind": a.kind, "flip": a.flip, "padding": a.padding, "scale": list(a.scale),
                 "view_seed": a.view_seed, "mix": a.mix, "mix_alpha": a.mix_alpha},
        precision=precision.name, cosine_layer=teacher.stored_layer, cosine_width=teacher.stored_width,
        teacher_code=teacher_code, feature_copy=1 if teacher.stored_layer else 0)
    store = TeacherOutputStore(folder, spec)
    plan = store.prepare(env)
    dist.on_main(env, store.check_disk, plan["missing"])
    return store, plan


def fill_store(store, plan, teacher, train_set, env, batch_size, precision, shown):
    """Build what the store lacks (or nothing), open it, and return what it cost for the metrics; `shown` is the
    store folder as the log names it."""
    if store is None:
        if env.is_main and plan == NO_TEACHER_LOSS:
            log.info("distill: the teacher is not run: no loss needs it (every distillation weight is 0)")
        elif env.is_main:
            log.info("distill: the teacher runs on every batch (%s)", plan)
        return {"mode": "teacher on every batch", "why": plan}
    s = store.spec
    if env.is_main:
        what = (f"{s.views} view(s) x {s.samples:,} images, {s.bytes_per_row()} bytes each "
                f"({'all' if s.dense else f'top {s.top_k} of'} {s.classes} logits), {s.total_bytes() / 1e6:.1f} MB")
        verb = {"reuse": "reusing", "resume": "resuming the build of", "build": "building", "extend": "extending",
                "rebuild": "rebuilding"}[plan["status"]]
        log.info("distill: teacher outputs: %s the store in %s: %s (%s)", verb, shown, what, plan["reason"])
    start = time.perf_counter()
    if plan["missing"]:
        store.build(teacher, train_set, env, batch_size, lambda x: precision.inputs(x, env.device), plan,
                    precision.autocast)
    seconds = time.perf_counter() - start  # read once: the log line and the stage's metrics say the same time
    if plan["missing"] and env.is_main:
        log.info("distill: teacher outputs for %d chunk(s) computed in %.1fs", len(plan["missing"]), seconds)
    store.open()
    return store.describe(plan, seconds)
