"""The timing protocol (compress.deploy.timing): the files are timed in turns, the order rotating a round."""



def test_the_latency_table_times_the_files_in_turns():
    """The report's latency table: each file gets its timed runs in rounds whose order rotates, so a busy neighbour
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
        ["int8"] * 4 + ["ptq"] * 4 + ["fp32"] * 4  # warm-up and one untimed run each; round 2 rotated by one


def test_every_file_takes_every_place_in_the_order():
    """Rounds rotate the order: over as many rounds as files, each file is timed first, in the middle and last
    once (an order reversed every other round keeps the middle file in the middle, after another file's session,
    in every round), and two files still alternate."""
    from compress.deploy.timing import compare_latency

    def order(names, rounds):
        calls = []
        models = {name: (lambda x, name=name: calls.append(name)) for name in names}
        compare_latency(models, None, rounds=rounds, budget_s=0.0, warmup=0, most=3)
        timed = calls[len(names):]  # after one untimed run each
        return [timed[i] for i in range(0, len(timed), 3)]  # each turn is 3 runs of one file

    turns = order(["fp32", "int8", "ptq"], 3)
    places = [turns[i:i + 3] for i in range(0, 9, 3)]
    assert all(sorted(round_) == ["fp32", "int8", "ptq"] for round_ in places)
    assert all(sorted(r[place] for r in places) == ["fp32", "int8", "ptq"] for place in range(3))
    assert order(["fp32", "int8"], 4) == ["fp32", "int8", "int8", "fp32", "fp32", "int8", "int8", "fp32"]


def test_sessions_stop_spinning_between_calls(tmp_path):
    """Every onnxruntime session compress opens (the latency table's, bench's, predict's and eval's) lets its
    threads sleep when a call returns: spinning, they would slow whichever file is timed next."""
    import onnx
    from onnx import TensorProto, helper

    from compress.deploy.onnx_model import OnnxModel

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), tmp_path / "relu.onnx")
    options = OnnxModel(str(tmp_path / "relu.onnx"), threads=2, require_metadata=False).session.get_session_options()
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    assert options.intra_op_num_threads == 2


def test_fewer_threads_names_the_batch_sizes_where_a_file_ran_faster_on_fewer_threads(capsys):
    """A small int8 model at batch 1 can run faster on 1 thread than on 2; beyond the 10 % a busy machine moves a
    cell, the batch size is named with both figures (for the report's note and `compress bench`'s line)."""
    from compress.cli.deploy_cmds import _print_fewer_threads
    from compress.deploy.timing import fewer_threads

    def cells(b1_t1, b1_t2, b64_t1, b64_t2):
        return [{"batch": 1, "threads": 1, "ms": b1_t1}, {"batch": 64, "threads": 1, "ms": b64_t1},
                {"batch": 1, "threads": 2, "ms": b1_t2}, {"batch": 64, "threads": 2, "ms": b64_t2}]

    int8 = cells(0.136, 0.170, 6.63, 5.18)
    assert fewer_threads(int8) == [(1, 1, 0.136, 2, 0.170)]
    assert fewer_threads(cells(0.41, 0.32, 17.9, 12.7)) == []  # fp32: faster on more threads
    assert fewer_threads(cells(0.160, 0.170, 6.63, 5.18)) == []  # 6 % apart: within a busy machine's noise
    assert fewer_threads([{"batch": 1, "threads": 2, "ms": 0.2}]) == []  # one thread count measured
    _print_fewer_threads({"A": "fp32.onnx", "B": "int8.onnx"}, {"A": cells(0.41, 0.32, 17.9, 12.7), "B": int8}, False)
    assert capsys.readouterr().out == ("B at batch 1: faster on 1 thread (0.136 ms) than on 2 (0.170 ms) - too little "
                                       "work per layer to split; give the runtime 1 thread for batches of 1\n")
    # timed beside busy neighbours, fewer threads win because the others are taken: said once, after every line
    _print_fewer_threads({"A": "fp32.onnx", "B": "int8.onnx"}, {"A": int8, "B": int8}, True)
    assert capsys.readouterr().out.splitlines() == [
        "A at batch 1: faster on 1 thread (0.136 ms) than on 2 (0.170 ms) - too little work per layer to split; give "
        "the runtime 1 thread for batches of 1",
        "B at batch 1: faster on 1 thread (0.136 ms) than on 2 (0.170 ms); give the runtime 1 thread for batches of 1",
        "(measured while other processes kept CPUs busy, where fewer threads win because the others are taken: time "
        "again on a quiet machine before acting on these lines)"]
