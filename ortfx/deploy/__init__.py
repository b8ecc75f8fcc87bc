"""Train, then deploy: a module written as one standard ONNX file for inference, checked in a
fresh ONNX Runtime session against the module's own eval outputs before it is handed back.

:func:`export_for_inference` is the one call. The file holds standard ONNX operators (and, where
ORT's optimizer puts them, its ``com.microsoft`` contrib operators), never ortfx's training-only
nodes (``PythonOp``, ``ATen``). Its inputs and outputs are the call's and the result's tensor
leaves, flattened as ortfx flattens a call (:mod:`ortfx.io`), named by their paths, and listed
with the call's structure in the model's ``metadata_props`` (key ``"ortfx"``, plain JSON).

- :mod:`~ortfx.deploy.inference`: :func:`export_for_inference` and :class:`InferenceExport`;
- :mod:`~ortfx.deploy.names`: graph names from leaf paths, dynamic axes, the JSON metadata;
- :mod:`~ortfx.deploy.tracing`: the eager reference and the trace, the model left as it was;
- :mod:`~ortfx.deploy.files`: the domain check, writing (external data), moving into place;
- :mod:`~ortfx.deploy.check`: ORT's optimization and the comparison in fresh sessions.
"""

from ortfx.deploy.inference import InferenceExport, export_for_inference

__all__ = ["InferenceExport", "export_for_inference"]
