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
