"""Export a module, for one call schema, to an ONNX model over flat tensors.

The only package that runs the torch ONNX exporters. A reader finds:

- :mod:`~ortfx.export.trace`: :func:`export` itself, the flat call it traces, the graph's inputs;
- :mod:`~ortfx.export.exporters`: the TorchScript and dynamo exporters as ortfx drives them;
- :mod:`~ortfx.export.reads`: what the forward reads while traced (grad mode, autograd
  attributes, gradient hooks, its own no-grad regions), watched on the exporting thread only;
- :mod:`~ortfx.export.rewrites`: what an export changes around the forward and undoes (RNG
  streams, buffers, BatchNorm statistics, checkpointed functions);
- :mod:`~ortfx.export.functions`: custom autograd Functions as ORT PythonOp nodes;
- :mod:`~ortfx.export.symbolics` and :mod:`~ortfx.export.translations`: what the exporters
  lack or get wrong, for ortfx's own exports only.
"""

from ortfx.export.exporters import BRANCH, resolve_exporter, torchscript_available
from ortfx.export.reads import (
    AN_INPUT_READ,
    COMPUTED_OR_COPY,
    GRADIENT_HOOK_IN_FORWARD,
    INTERMEDIATE_REQUIRES_GRAD,
    MADE_TO_REQUIRE_GRAD,
)
from ortfx.export.trace import Exported, export, exporting, raise_if_pytorch_raises

__all__ = [
    "AN_INPUT_READ",
    "BRANCH",
    "COMPUTED_OR_COPY",
    "GRADIENT_HOOK_IN_FORWARD",
    "INTERMEDIATE_REQUIRES_GRAD",
    "MADE_TO_REQUIRE_GRAD",
    "Exported",
    "export",
    "exporting",
    "raise_if_pytorch_raises",
    "resolve_exporter",
    "torchscript_available",
]
