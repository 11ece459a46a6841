"""The run machinery: the config (`config`, `schema`), the run directory, its manifest and lock (`rundir`),
what each stage must do (`state`), the context a stage gets (`context`, `contract`), the pipeline that runs
the stages (`pipeline`), checks before anything is written (`preflight`), the report, and the torchrun
re-launch (`launch`).

May import every other package of compress and `stages`; nothing but the CLI and the stages imports it."""
