"""What a stage module declares and returns - the contract between the pipeline and `stages/<name>.py`:

    NAME, SUMMARY      its name (the same word everywhere) and one line for `compress stages`
    CONFIG_KEYS        the config keys it depends on (a change reruns it; it may read nothing else but `train`);
                       a key written with a leading '-' (LEFT_OUT) leaves that part out of a section it otherwise
                       reads
    OUTPUTS            {output name: run-relative path}: the only place its file paths are written down
    PARTS              the models it trains, each with its own resume checkpoint ("" first; distill: "baseline")
    RANK0_ONLY         whether it runs on rank 0 alone (export) or on every rank (the training stages)
    inputs(cfg)        [Input(stage, output, required) | File(path, key) | Images(key) | Code(key)]: every file it
                       reads
    run(ctx)           -> StageResult
    report_rows(entry, path)   its rows of the run report, read from its own OUTPUTS via `path(output)`

A worked example - the teacher stage declares

    CONFIG_KEYS = ("seed", "data", "-data.unlabeled", "model.teacher", "model.teacher_weights", "teacher")
    OUTPUTS = {"model": "teacher/model.safetensors", "metrics": "teacher/metrics.json"}
    def inputs(cfg): return [Images("root"), Code("model.teacher"), File(<weights file>, "model.teacher_weights")]

so: changing `teacher.lr`, `seed` or a `data.*` key that changes the pixels it trains on reruns it, and
`data.unlabeled` does not (the teacher never sees the unlabelled images); `train.*` never does (how to run, not
what to compute); `ctx.cfg.distill` inside it raises UndeclaredConfigRead naming these keys (reading a key it does
not declare would let its outputs go stale silently); images added to data.root, an edit of the model's own code,
or another weights file rerun it through `inputs`; and it may write only the two files of OUTPUTS (plus its
resume checkpoint under teacher/last/ and, with tensorboard installed, its log under teacher/tensorboard/).

A declared key changes nothing when it cannot change the result: `config.result_hash` compares the slice without
the keys of `config.NO_RESULT` (how images are held or fetched: data.cache_mb, data.cache_dir, data.download),
`UNUSED_BY_AUGMENT` (crop keys the chosen data.augment does not read), `AS_BEFORE_WHEN_NULL` left at null (keys
added later whose null reproduces what ran before), and - where the images' listing digest is an input -
`COVERED_BY_LISTING` (data.val_fraction, split_seed, limit: the listing already holds their effect). Those
rules live there, beside the hash, and nowhere else.
"""

import os
from dataclasses import dataclass, field
from typing import NamedTuple

EXTERNAL = "external:"


class Input(NamedTuple):
    """A file a stage reads from an upstream stage: the upstream stage's name and the name of the output (a
    key of that stage's OUTPUTS). An optional input that is absent or not current is simply not given."""

    stage: str
    output: str
    required: bool = True


class File(NamedTuple):
    """A file a stage reads from outside the run directory (pretrained weights), named by a config key; its
    sha256 is an input of the stage, so changing the file reruns it."""

    path: str
    key: str

    @property
    def input_key(self):
        return EXTERNAL + os.path.abspath(os.path.expanduser(self.path))


class Images(NamedTuple):
    """The images a data key points at ("root": the labelled images, "unlabeled": data.unlabeled's): a digest
    of their listing (names, sizes, classes; `compress.data.imagefolder.listing_digest`) is an input of the
    stage, so images added, removed, renamed or moved between classes run it again."""

    key: str

    @property
    def input_key(self):
        return f"{IMAGES_DIGEST} data.{self.key}"

    @property
    def bytes_key(self):
        """The digest of their bytes (`compress.data.imagefolder.bytes_digest`): an image edited in place, its
        size unchanged, runs the stage again too."""
        return f"{IMAGE_BYTES_DIGEST} data.{self.key}"


class Code(NamedTuple):
    """The source file of a user's model (`model.teacher` / `model.student` given as `<module>:<function>`): its
    sha256 is an input of the stage, so editing the model's code runs the stages that build it again."""

    key: str  # "model.teacher" or "model.student"

    @property
    def input_key(self):
        return f"{CODE_DIGEST} {self.key}"


LEFT_OUT = "-"  # CONFIG_KEYS: '-data.unlabeled' = every key of `data` but `unlabeled`
IMAGES_DIGEST = f"{EXTERNAL}images in"  # input keys of Images (a listing's digest, not a file of its own)
IMAGE_BYTES_DIGEST = f"{EXTERNAL}image bytes in"  # the bytes of those images (all up to 256 MB, a sample beyond)
CODE_DIGEST = f"{EXTERNAL}code of"  # input keys of Code (a model's source file)
DIGESTS = (IMAGES_DIGEST, IMAGE_BYTES_DIGEST, CODE_DIGEST)  # inputs that are not files of their own


@dataclass
class StageResult:
    metrics: dict
    outputs: list = field(default_factory=list)  # run-relative paths the stage wrote
    summary: str = ""
