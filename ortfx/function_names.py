"""Graph names of custom ``torch.autograd.Function`` classes, shared by the exporter (which
writes them into PythonOp nodes) and ORT's runner (which registers the classes under them).

The graph name is the fully qualified class name; a second class with the same name (a class
defined again by a factory) gets a ``#n`` suffix, so ORT never runs the wrong one. A graph can
name only classes this process exported.
"""

from __future__ import annotations

import threading

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
    missing = names - _FUNCTIONS.keys()
    if missing:
        raise OrtfxExportError(
            f"the graph runs autograd.Function(s) {sorted(missing)} that this process never "
            "exported; PythonOp graphs can only run in the process that exported them."
        )
    return {name: _FUNCTIONS[name] for name in names}
