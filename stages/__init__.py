"""The stages, in pipeline order. Each module has NAME, SUMMARY, CONFIG_KEYS, OUTPUTS, RANK0_ONLY,
inputs(cfg) -> [(stage, run-relative path)], and run(ctx) -> StageResult. Stages never import each other:
they meet only through files in the run directory."""

from stages import distill, export, qat, teacher

STAGES = {
    "teacher": teacher,
    "distill": distill,
    "qat": qat,
    "export": export,
}

ORDER = tuple(STAGES)  # the canonical order
