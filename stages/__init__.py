"""The stages, in pipeline order. Each module has

    NAME, SUMMARY      its name (the same word everywhere) and one line for `compress stages`
    CONFIG_KEYS        the config keys it depends on (a change reruns it)
    OUTPUTS            {output name: run-relative path}: the only place its file paths are written down
    RANK0_ONLY         whether it runs on rank 0 alone (export) or on every rank (the training stages)
    inputs(cfg)        [compress.context.Input(stage, output, required)]: every file it reads from another stage
    run(ctx)           -> StageResult
    report_rows(entry, path)   its rows of the run report, read from its own OUTPUTS via `path(output)`

Stages never import each other: they meet only through files in the run directory."""

from stages import distill, export, qat, teacher

STAGES = {
    "teacher": teacher,
    "distill": distill,
    "qat": qat,
    "export": export,
}

ORDER = tuple(STAGES)  # the canonical order
