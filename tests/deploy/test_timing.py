"""The timing protocol (compress.deploy.timing): the files are timed in alternating rounds."""



def test_the_latency_table_times_the_files_in_turns():
    """The report's latency table: each file gets its timed runs in rounds that alternate, so a busy neighbour
    slows all of them alike (timed one after the other, the same PTQ and QAT files can read 2.09 and 4.99 ms on a
    loaded machine), and a file runs several times in a row each round after a warm-up, so its first runs do not
    share the cores with the previous session's spinning threads (fp32 4.4 ms in a table, 1.9 ms alone)."""
    from compress.deploy.timing import compare_latency

    calls = []
    models = {name: (lambda x, name=name: calls.append(name)) for name in ("fp32", "int8", "ptq")}
    times = compare_latency(models, None, rounds=2, budget_s=1.0, warmup=1, most=4)
    assert set(times) == {"fp32", "int8", "ptq"} and all(t["runs"] == 8 and t["median_ms"] >= 0
                                                          for t in times.values())
    assert calls == ["fp32"] * 2 + ["int8"] * 2 + ["ptq"] * 2 + ["fp32"] * 4 + ["int8"] * 4 + ["ptq"] * 4 + \
        ["ptq"] * 4 + ["int8"] * 4 + ["fp32"] * 4  # warm-up and one untimed run each; round 1 in order, 2 reversed
