"""What the pipeline hands a stage, and what a stage hands back."""

from dataclasses import dataclass, field
from typing import Callable

from compress import __version__
from compress.checkpoint import load_weights
from compress.config import Config
from compress.dist import DistEnv
from compress.models import build_model
from compress.rundir import RunDir


@dataclass
class StageContext:
    cfg: Config
    run: RunDir
    env: DistEnv
    stage: str
    config_hash: str
    inputs: dict  # run-relative path -> sha256 recorded by the stage that wrote it
    resume: bool  # continue from <stage>/last/ (the pipeline checked it matches this config and these inputs)
    begin: Callable = lambda: None  # call (every rank) after loading inputs, before writing anything

    def stage_path(self, *parts):
        return self.run.path(self.stage, *parts)

    def load_model(self, rel, model_name, data, expect_stage):
        """Build `model_name` for the data's shape and load the upstream stage's weights (on the CPU),
        checking sha256 against the manifest and the model name against the checkpoint's metadata."""
        model = build_model(model_name, data.input_shape, data.num_classes)
        meta = load_weights(model, self.run.path(rel), expect_stage=expect_stage, expect_model=model_name,
                            expect_sha256=self.inputs.get(rel))
        return model, meta

    def weights_metadata(self, model_name, data, parent=None):
        """Metadata stored with a stage's final weights: enough to rebuild the model and its preprocessing."""
        return {"stage": self.stage, "model": model_name, "config_hash": self.config_hash,
                "parent_sha256": parent or "", "input_shape": list(data.input_shape),
                "class_names": list(data.class_names), "mean": list(data.mean), "std": list(data.std),
                "dataset": data.name, "compress_version": __version__}


@dataclass
class StageResult:
    metrics: dict
    outputs: list = field(default_factory=list)  # run-relative paths the stage wrote
    summary: str = ""
