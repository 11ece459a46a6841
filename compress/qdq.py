"""Clean QuantizeLinear/DequantizeLinear graphs: what the TorchScript exporter leaves that other ONNX
consumers trip over or that makes onnxruntime pick a slow kernel. Each rewrite computes exactly the same values.

- A `Cast(to=uint8)` between QuantizeLinear and DequantizeLinear is a no-op (QuantizeLinear already outputs
  the zero point's type), but it splits the Q->DQ pair that other runtimes pattern-match: removed.
- After a layer kept in float, FX quantizes *before* a following MaxPool (Q -> DQ -> MaxPool -> Q, one scale),
  and onnxruntime then runs a slow uint8 MaxPool in NCHW. Max-pooling commutes with quantization (both are
  monotonic), so the pool moves before the Q and runs in float: MaxPool -> Q.
"""

import numpy as np
from onnx import helper

_PASS_THROUGH = ("Relu", "Clip")


def clean_qdq(nodes, consts):
    """Rewrite `nodes` (a list of NodeProto, graph order) in place; `consts` maps initializer names to arrays."""
    _drop_noop_casts(nodes, consts)
    _hoist_max_pools(nodes, consts)
    return nodes


def _producers(nodes):
    return {out: node for node in nodes for out in node.output}


def _consumers(nodes):
    found = {}
    for node in nodes:
        for name in node.input:
            found.setdefault(name, []).append(node)
    return found


def _rename_input(nodes, old, new):
    for node in nodes:
        node.input[:] = [new if name == old else name for name in node.input]


def _zero_point_dtype(q, consts):
    if len(q.input) > 2 and q.input[2] in consts:
        return consts[q.input[2]].dtype
    return np.dtype(np.uint8)  # the ONNX default when no zero point is given


def _drop_noop_casts(nodes, consts):
    producers = _producers(nodes)
    for node in list(nodes):
        if node.op_type != "Cast":
            continue
        q = producers.get(node.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue
        to = helper.tensor_dtype_to_np_dtype(helper.get_attribute_value(node.attribute[0]))
        if np.dtype(to) == _zero_point_dtype(q, consts):
            _rename_input(nodes, node.output[0], node.input[0])
            nodes.remove(node)


def _same_qparams(a, b, consts):
    try:
        return all(np.array_equal(consts[x], consts[y]) for x, y in zip(a.input[1:3], b.input[1:3]))
    except KeyError:
        return False


def _is_float_source(name, producers):
    """`name` is computed by a float op (not one onnxruntime fuses into an int8 kernel): its producer, looking
    through Relu/Clip, takes no dequantized input. Graph inputs count as float sources."""
    node = producers.get(name)
    while node is not None and node.op_type in _PASS_THROUGH:
        node = producers.get(node.input[0])
    if node is None:
        return True
    return not any((producers.get(i) is not None and producers[i].op_type == "DequantizeLinear") for i in node.input)


def _hoist_max_pools(nodes, consts):
    producers, consumers = _producers(nodes), _consumers(nodes)
    for pool in [n for n in nodes if n.op_type == "MaxPool"]:
        dq = producers.get(pool.input[0])
        q = producers.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear" or len(pool.output) != 1:
            continue
        after = consumers.get(pool.output[0], [])
        if not after or not all(n.op_type == "QuantizeLinear" and _same_qparams(n, q, consts) for n in after):
            continue
        if len(consumers.get(q.output[0], [])) != 1 or len(consumers.get(dq.output[0], [])) != 1:
            continue
        if not _is_float_source(q.input[0], producers):
            continue  # an int8 producer: onnxruntime runs the pool in uint8 (NHWC), which is fast
        pool.input[0] = q.input[0]
        nodes.remove(q)
        nodes.remove(dq)
    return nodes
