"""Latency tables (compress.deploy.latency): a row per (batch, threads) cell for every file."""

import pytest

pytestmark = pytest.mark.e2e



def test_latency_tables_of_several_files_have_a_row_per_cell(finished_run):
    from compress.deploy.latency import latency_tables

    export = finished_run / "export"
    paths = {k: export / f"model.{k}.onnx" for k in ("fp32", "int8", "ptq")}
    tables = latency_tables(paths, (1, 4), threads=(1,), repeats=3, warmup=1)
    assert set(tables) == set(paths)
    assert all([(r["batch"], r["threads"]) for r in rows] == [(1, 1), (4, 1)] and all(r["ms"] > 0 for r in rows)
               for rows in tables.values())
