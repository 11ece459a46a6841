"""Clean QuantizeLinear/DequantizeLinear graphs: what the TorchScript exporter leaves that other ONNX
consumers trip over or that makes onnxruntime pick a slow kernel. Each rewrite computes exactly the same values.

- A `Cast(to=uint8)` between QuantizeLinear and DequantizeLinear is a no-op (QuantizeLinear already outputs
  the zero point's type), but it splits the Q->DQ pair that other runtimes pattern-match: removed.
- After a layer kept in float, FX quantizes *before* a following MaxPool (Q -> DQ -> MaxPool -> Q, one scale),
  and onnxruntime then runs a slow uint8 MaxPool in NCHW. Max-pooling commutes with quantization (both are
  monotonic), so the pool moves before the Q and runs in float: MaxPool -> Q.
- A float MaxPool that feeds a QuantizeLinear straight after a ReLU (a float stem: Conv -> Relu -> MaxPool -> Q)
  is undone by onnxruntime: its QDQ propagation moves the Q up across the pool (not across a ReLU), back to the
  slow uint8 NCHW MaxPool (9 ms of a 13 ms resnet10_half at batch 64). ReLU and clamps commute with max-pooling,
  so the pool goes first: Conv -> MaxPool -> Relu -> Q, and the Q stays after the pool.
- A clamp between two quantizations with the same parameters (ReLU6 in mobilenets: Q -> DQ -> Clip(0, 6) -> Q)
  runs in float, three passes over the tensor that onnxruntime cannot fuse into its int8 kernels (60 % of int8
  mobilenet_v2's time at 64x64). On the integers it is a clamp to [Q(0), Q(6)]: Q -> Clip(uint8).
"""

import numpy as np
from onnx import helper

_PASS_THROUGH = ("Relu", "Clip")


def clean_qdq(nodes, consts):
    """Rewrite `nodes` (a list of NodeProto, graph order) in place; `consts` maps initializer names to arrays."""
    _drop_noop_casts(nodes, consts)
    _hoist_max_pools(nodes, consts)
    _pools_before_activations(nodes, consts)
    _integer_clips(nodes, consts)
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


def _pools_before_activations(nodes, consts):
    """Relu/Clip -> MaxPool -> QuantizeLinear becomes MaxPool -> Relu/Clip -> QuantizeLinear (same values: both
    are monotonic, and MaxPool's padding never wins a max), in the float part of the graph, when the activation
    feeds only the pool and the pool only quantizations."""
    producers, consumers = _producers(nodes), _consumers(nodes)
    for pool in [n for n in nodes if n.op_type == "MaxPool" and len(n.output) == 1]:
        act = producers.get(pool.input[0])
        if act is None or act.op_type not in _PASS_THROUGH or len(consumers.get(act.output[0], [])) != 1:
            continue
        if not _is_float_source(act.input[0], producers):
            continue  # in the int8 part the pool runs in uint8 NHWC, and a clamp on the integers needs its DQ
        if act.op_type == "Clip" and any(name and name not in consts for name in act.input[1:]):
            continue  # a bound computed at run time
        after = consumers.get(pool.output[0], [])
        if not after or not all(n.op_type == "QuantizeLinear" for n in after):
            continue
        source, middle, out = act.input[0], act.output[0], pool.output[0]
        pool.input[0], pool.output[0] = source, middle
        act.input[0], act.output[0] = middle, out
        nodes.remove(act)
        nodes.insert(nodes.index(pool) + 1, act)  # graph order: the activation now reads the pool's output
    return nodes


def _scalar(name, consts):
    value = consts.get(name)
    return float(value) if value is not None and value.size == 1 else None


def _integer_clips(nodes, consts):
    producers, consumers = _producers(nodes), _consumers(nodes)
    for clip in [n for n in nodes if n.op_type == "Clip"]:
        dq = producers.get(clip.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or len(consumers.get(dq.output[0], [])) != 1:
            continue
        after = consumers.get(clip.output[0], [])
        if not after or not all(n.op_type == "QuantizeLinear" and _same_qparams(n, dq, consts) for n in after):
            continue
        bounds = [_scalar(name, consts) if name else None for name in (list(clip.input[1:3]) + ["", ""])[:2]]
        if any(name and b is None for name, b in zip(clip.input[1:3], bounds)):
            continue  # a bound computed at run time
        scale, zero_point = _scalar(dq.input[1], consts), consts.get(dq.input[2]) if len(dq.input) > 2 else None
        if scale is None or zero_point is None or zero_point.size != 1 or zero_point.dtype not in (np.uint8, np.int8):
            continue
        info = np.iinfo(zero_point.dtype)
        limits = []
        for bound, default in zip(bounds, (info.min, info.max)):
            # QuantizeLinear: saturate(round_half_to_even(x / scale) + zero_point)
            q = default if bound is None else np.clip(np.rint(np.float32(bound) / np.float32(scale)) + int(zero_point),
                                                      info.min, info.max)
            name = f"{clip.output[0]}_{'min' if not limits else 'max'}_q"
            consts[name] = np.array(q, dtype=zero_point.dtype)
            limits.append(name)
        clip.input[:] = [dq.input[0], *limits]
        for q in after:
            _rename_input(nodes, q.output[0], clip.output[0])
            nodes.remove(q)
        nodes.remove(dq)
    return nodes
