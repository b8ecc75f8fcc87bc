"""Graph names of custom ``torch.autograd.Function`` classes, shared by the exporter (which
writes them into PythonOp nodes) and ORT's runner (which registers the classes under them).

The graph name is the fully qualified class name; a second class with the same name (a class
defined again by a factory) gets a ``#n`` suffix, so ORT never runs the wrong one. A graph can
name only classes this process exported.

A node's ``func_name`` is the graph name, plus ``|bool=i,j`` when arguments ``i, j`` of its
``apply`` are bool tensors (ORT hands bool tensors to the runner as uint8: DLPack has no bool in
ORT 1.19), ``|number=m`` when argument ``m`` is a Python number in eager that the tracer made a
0-dim tensor (a size), and ``|node=k``, its number among the graph's PythonOps (the runner
reports which node's backward gave no gradient for an input). The name is the only per-node
text ORT passes to the runner.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import attrs
import onnx

from ortfx.errors import OrtfxExportError

# Graph name -> Function class, and back.
_FUNCTIONS: dict[str, type] = {}
_FUNCTION_NAMES: dict[type, str] = {}
_NAMES_LOCK = threading.Lock()


def function_graph_name(cls: type) -> str:
    """The name ``cls`` has in exported graphs and in ORT's function registry."""
    with _NAMES_LOCK:
        name = _FUNCTION_NAMES.get(cls)
        if name is None:
            base = name = f"{cls.__module__}.{cls.__qualname__}"
            n = 1
            while name in _FUNCTIONS:
                n += 1
                name = f"{base}#{n}"
            _FUNCTIONS[name] = cls
            _FUNCTION_NAMES[cls] = name
        return name


@attrs.frozen
class NodeName:
    """What a PythonOp node's ``func_name`` says besides its class (see the module docstring)."""

    bools: frozenset[int] = frozenset()  # apply() positions of bool tensor arguments
    numbers: frozenset[int] = frozenset()  # ... of Python numbers the tracer made tensors
    node: int | None = None  # the node's number among the graph's PythonOps


def node_function_name(cls: type, bools: Sequence[int], numbers: Sequence[int] = ()) -> str:
    """A PythonOp node's ``func_name``: ``cls``'s graph name, its bool tensor arguments and
    its Python-number arguments."""
    parts = [function_graph_name(cls)]
    for kind, positions in (("bool", bools), ("number", numbers)):
        if positions:
            parts.append(f"{kind}={','.join(map(str, sorted(positions)))}")
    return "|".join(parts)


def numbered(func_name: str, node: int) -> str:
    """``func_name`` with the node's number among the graph's PythonOps appended."""
    return f"{func_name}|node={node}"


@functools.lru_cache(maxsize=1024)
def parse_node_name(func_name: str) -> NodeName:
    """The :class:`NodeName` a node's ``func_name`` carries."""
    parts = dict(part.partition("=")[::2] for part in func_name.split("|")[1:])
    node = parts.get("node")

    def positions(kind: str) -> frozenset[int]:
        listed = parts.get(kind)
        return frozenset(int(p) for p in listed.split(",")) if listed else frozenset()

    return NodeName(positions("bool"), positions("number"), int(node) if node is not None else None)


def pythonop_functions(model: bytes) -> dict[str, type]:
    """The Function classes the PythonOp nodes of a serialized model run, by graph name."""
    if b"PythonOp" not in model:
        return {}
    names = {
        onnx.helper.get_attribute_value(a).decode()
        for node in onnx.load_model_from_string(model).graph.node
        if node.op_type == "PythonOp" and node.domain == "com.microsoft"
        for a in node.attribute
        if a.name == "func_name"
    }
    classes = {name: _FUNCTIONS.get(name.partition("|")[0]) for name in names}
    missing = sorted(name for name, cls in classes.items() if cls is None)
    if missing:
        raise OrtfxExportError(
            f"the graph runs autograd.Function(s) {missing} that this process never "
            "exported; PythonOp graphs can only run in the process that exported them."
        )
    return {name: cls for name, cls in classes.items() if cls is not None}
