"""The stages, in pipeline order: the recipes of this project, one module each (teacher, distill, qat, export),
each following the contract in `compress.run.contract` (NAME, CONFIG_KEYS, OUTPUTS, inputs, run, report_rows).

Stages never import each other: they meet only through files in the run directory. `STAGES` imports a stage
module on first use, so code that needs only the names (`ORDER`: the CLI's --help) does not import torch."""

import importlib
from collections.abc import Mapping

ORDER = ("teacher", "distill", "qat", "export")


class _Stages(Mapping):
    """name -> stage module, in pipeline order."""

    def __getitem__(self, name):
        if name not in ORDER:
            raise KeyError(name)
        return importlib.import_module(f"stages.{name}")

    def __iter__(self):
        return iter(ORDER)

    def __len__(self):
        return len(ORDER)


STAGES = _Stages()
