"""Dropout and ORT's other random nodes: the mask output Dropout's gradient reads, and a seed for
every random node, so that a session's draws are reproducible and no two streams coincide."""

from __future__ import annotations

import hashlib
from typing import Any

import onnx

from ortfx.passes.core import Pass, graph_pass, is_standard


@graph_pass
def add_dropout_masks(model: onnx.ModelProto) -> bool:
    """Give every Dropout its mask output: DropoutGrad reads it (dynamo exports omit it)."""
    changed = False
    for i, node in enumerate(model.graph.node):
        if is_standard(node, "Dropout") and len(node.output) < 2:
            node.output.append(f"{node.name or f'Dropout_{i}'}_mask")
            changed = True
    return changed


# ONNX's random ops and the type of their ``seed`` attribute. Unseeded, ORT seeds the generators
# from the clock (other runs draw other numbers), and a seed restarts its stream in every new
# session; Dropout's is an integer, the others' a float (exact up to 2**24).
_SEED_BITS = {
    "Dropout": 31,
    "RandomUniform": 24,
    "RandomUniformLike": 24,
    "RandomNormal": 24,
    "RandomNormalLike": 24,
    "Bernoulli": 24,
    "Multinomial": 24,
}


def _mix(*parts: bytes | int) -> int:
    """A 64-bit digest of ``parts``: independent seeds from related inputs, the same in every
    process (Python's ``hash`` is salted per process)."""
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.to_bytes(8, "little"))
        digest.update(b"|")
    return int.from_bytes(digest.digest(), "little")


def session_seed(torch_state: bytes, session: int) -> int:
    """The seed of one ORT session's random nodes: from torch's generator state (read, never
    drawn from: the same torch seed and the same program give the same masks, run to run) and
    the wrapper's count of sessions made before it (a new session after a re-process starts a
    new stream instead of repeating the first one's)."""
    return _mix(torch_state, session)


def random_ops(model: bytes) -> tuple[str, ...]:
    """The kinds of random nodes in ``model`` (Dropout, RandomNormal, ...), each once; a
    Dropout whose ratio is a constant 0 draws nothing (transformers' default configs)."""
    graph = onnx.load_model_from_string(model).graph
    zeros = {i.name for i in graph.initializer if _is_zero(onnx.numpy_helper.to_array(i))}
    for node in graph.node:
        if node.op_type == "Constant" and not node.domain:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and _is_zero(onnx.numpy_helper.to_array(value)):
                zeros.add(node.output[0])
    found = []
    for node in graph.node:
        if node.op_type not in _SEED_BITS or node.domain:
            continue
        if node.op_type == "Dropout" and (
            len(node.input) < 2 or not node.input[1] or node.input[1] in zeros
        ):
            continue  # no ratio input means 0.5 in ONNX, but the exporter always writes one
        found.append(node.op_type)
    return tuple(dict.fromkeys(found))


def _is_zero(array: Any) -> bool:
    return bool(array.size == 1 and float(array.reshape(())) == 0.0)


def seed_random_nodes(seed: int) -> Pass:
    """Give each random node (Dropout, RandomUniform, Bernoulli, ...) its own seed from ``seed``
    and its position among the graph's random nodes. The position, not the node's index: nodes
    added elsewhere in the graph (the convergence hooks' PythonOps) then change no mask."""

    @graph_pass
    def run(model: onnx.ModelProto) -> bool:
        position = 0
        for node in model.graph.node:
            bits = _SEED_BITS.get(node.op_type)
            if bits is None or not is_standard(node, node.op_type):
                continue
            value = _mix(seed, position) % 2**bits
            position += 1
            kept = [a for a in node.attribute if a.name != "seed"]
            del node.attribute[:]
            node.attribute.extend(kept)
            attribute = value if node.op_type == "Dropout" else float(value)
            node.attribute.append(onnx.helper.make_attribute("seed", attribute))
        return position > 0

    return run
