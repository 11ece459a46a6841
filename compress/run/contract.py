"""What a stage module declares and returns - the contract between the pipeline and `stages/<name>.py`:

    NAME, SUMMARY      its name (the same word everywhere) and one line for `compress stages`
    CONFIG_KEYS        the config keys it depends on (a change reruns it; it may read nothing else but `train`);
                       '-data.unlabeled' leaves a part out of a section it otherwise reads
    OUTPUTS            {output name: run-relative path}: the only place its file paths are written down
    PARTS              the models it trains, each with its own resume checkpoint ("" first; distill: "baseline")
    RANK0_ONLY         whether it runs on rank 0 alone (export) or on every rank (the training stages)
    inputs(cfg)        [Input(stage, output, required) | File(path, key) | Images(key) | Code(key)]: every file it
                       reads
    run(ctx)           -> StageResult
    report_rows(entry, path)   its rows of the run report, read from its own OUTPUTS via `path(output)`
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
        return f"{EXTERNAL}images in data.{self.key}"


class Code(NamedTuple):
    """The source file of a user's model (`model.teacher` / `model.student` given as `<module>:<function>`): its
    sha256 is an input of the stage, so editing the model's code runs the stages that build it again."""

    key: str  # "model.teacher" or "model.student"

    @property
    def input_key(self):
        return f"{EXTERNAL}code of {self.key}"


DIGESTS = (f"{EXTERNAL}images in", f"{EXTERNAL}code of")  # inputs that are not files of their own


@dataclass
class StageResult:
    metrics: dict
    outputs: list = field(default_factory=list)  # run-relative paths the stage wrote
    summary: str = ""
