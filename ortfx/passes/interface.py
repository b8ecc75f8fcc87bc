"""The graph's interface with ORT: the node outputs its gradients read that the exporters
leave out, one value per graph output, inputs in the training agent's order, and which scalar
leaves are fed as tensors."""

from __future__ import annotations

import attrs
import onnx

from ortfx.function_names import numbered
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.passes.core import Pass, graph_pass, is_standard


@graph_pass
def add_pythonop_ctx(model: onnx.ModelProto) -> bool:
    """Give each PythonOp ORT's leading ctx output (the exporter emits only the Function's)
    and its number among the graph's PythonOps in its ``func_name``
    (:func:`ortfx.function_names.numbered`)."""
    changed = False
    count = 0
    for i, node in enumerate(model.graph.node):
        if node.op_type != "PythonOp" or node.domain != "com.microsoft":
            continue
        name = node.name or f"PythonOp_{i}"
        outputs = list(node.output)
        del node.output[:]
        node.output.extend([f"{outputs[0] if outputs else name}_ctx", *outputs])
        node.name = name
        for attribute in node.attribute:
            if attribute.name == "func_name":
                attribute.s = numbered(attribute.s.decode(), count).encode()
        count += 1
        changed = True
    return changed


@graph_pass
def add_layernorm_stats(model: onnx.ModelProto) -> bool:
    """Name LayerNormalization's mean and inverse-std outputs: ORT's gradient reads them."""
    changed = False
    for i, node in enumerate(model.graph.node):
        if is_standard(node, "LayerNormalization") and len(node.output) < 3:
            base = node.name or f"LayerNormalization_{i}"
            outputs = [*node.output, "", ""][:3]
            outputs[1] = outputs[1] or f"{base}_saved_mean"
            outputs[2] = outputs[2] or f"{base}_saved_inv_std"
            del node.output[:]
            node.output.extend(outputs)
            changed = True
    return changed


@graph_pass
def add_cross_entropy_log_prob(model: onnx.ModelProto) -> bool:
    """Name SoftmaxCrossEntropyLoss's log_prob output: its gradient reads it, and the
    TorchScript exporter emits only the loss (the build then fails on many graphs)."""
    changed = False
    for i, node in enumerate(model.graph.node):
        if is_standard(node, "SoftmaxCrossEntropyLoss") and (
            len(node.output) < 2 or not node.output[1]
        ):
            outputs = [*node.output, ""][:2]
            outputs[1] = f"{node.name or f'SoftmaxCrossEntropyLoss_{i}'}_log_prob"
            del node.output[:]
            node.output.extend(outputs)
            changed = True
    return changed


def _has_symbolic_dim(value: onnx.ValueInfoProto) -> bool:
    dims = value.type.tensor_type.shape.dim
    return any(d.HasField("dim_param") for d in dims)


def _expand_constant(model: onnx.ModelProto, name: str, dynamic: str) -> None:
    """Rename the constant ``name`` and produce ``name`` from it with ``Expand`` by the empty
    shape ``Shape(dynamic)[0:0]``."""
    const = f"ortfx_{name}_constant"
    for node in model.graph.node:
        node.input[:] = [const if i == name else i for i in node.input]
        node.output[:] = [const if o == name else o for o in node.output]
    model.graph.node.extend(
        [
            onnx.helper.make_node("Shape", [dynamic], [f"{const}_shape"], start=0, end=0),
            onnx.helper.make_node("Expand", [const, f"{const}_shape"], [name], name=const),
        ]
    )


@graph_pass
def separate_outputs(model: onnx.ModelProto) -> bool:
    """Give each graph output its own value: a returned input or a tensor returned twice gets
    an Identity, so ORT yields (and takes gradients for) every output position separately. A
    constant output (ORT folds it into an initializer, which leaves its gradient builder and
    the session without a producer for it) is computed by a node ORT cannot fold."""
    inputs = {i.name for i in model.graph.input}
    constants = {o for n in model.graph.node if is_standard(n, "Constant") for o in n.output}
    dynamic = next((i.name for i in model.graph.input if _has_symbolic_dim(i)), None)
    seen: set[str] = set()
    changed = False
    for k, output in enumerate(model.graph.output):
        if output.name in constants and dynamic is not None and output.name not in seen:
            # An Identity would be folded back into an initializer: the output becomes the
            # constant expanded by an empty shape taken from an input with symbolic dims, which
            # ORT cannot fold. The output keeps its name (the runner fetches outputs by name).
            _expand_constant(model, output.name, dynamic)
            changed = True
        elif output.name in inputs or output.name in seen:
            fresh = f"{output.name}_output_{k}"
            model.graph.node.append(
                onnx.helper.make_node("Identity", [output.name], [fresh], name=f"ortfx_{fresh}")
            )
            output.name = fresh
            changed = True
        seen.add(output.name)
    return changed


def user_inputs_first(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
    """Order graph inputs as ORT's training agent feeds them: user inputs, then the rest."""
    order = sorted(info.inputs, key=lambda i: i.kind is not InputKind.USER)
    if order == list(info.inputs):
        return info
    model = onnx.load_model_from_string(info.model)
    by_name = {v.name: v for v in model.graph.input}
    values = [onnx.ValueInfoProto() for _ in order]
    for value, spec in zip(values, order, strict=True):
        value.CopyFrom(by_name[spec.name])
    del model.graph.input[:]
    model.graph.input.extend(values)
    return attrs.evolve(info, model=model.SerializeToString(), inputs=tuple(order))


def with_dynamic_scalars(paths: frozenset[str]) -> Pass:
    """Record which scalar leaves the graph reads as tensors (``Options.dynamic_scalars``)."""

    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        return info if info.dynamic_scalars == paths else attrs.evolve(info, dynamic_scalars=paths)

    return run
