"""Torch ops run by torch inside the ORT graph (ORT's ATen node): ops neither exporter can
express, and a few whose ORT CPU kernels are slower or keep more memory than torch's (the
cross-entropy, a hand-written tanh GELU, some gradients).

The TorchScript exporter writes a routed op as an ``org.pytorch.aten::ATen`` node (attributes
``operator`` and ``overload_name``; every argument an input, scalars as constants; the symbolics
are in :mod:`ortfx.export.routed`), or a graph pass does. ORT runs such a node through the
executor registered once per process (``register_aten_op_executor``): two plain-C functions in
``ortfx._bridge`` that call :func:`is_tensor_argument` and :func:`execute` here. Each routed
op's argument kinds are listed in :data:`ROUTED`, so no torch schema lookup is needed. A
differentiable one has its gradient in :data:`GRADIENTS` (routed ops too); the others get none.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import onnx
import torch
import torch.utils.dlpack

from ortfx.runtime import openmp

DOMAIN: Final = "org.pytorch.aten"


@attrs.frozen
class Routed:
    """An op run by torch inside the graph: its callable and the kind of each argument."""

    function: Callable[..., Any]
    arguments: tuple[str, ...]  # "tensor", "int", "float" or "bool"
    outputs: int = 1


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # torch.nn.functional.grouped_mm is the public spelling of aten::_grouped_mm (torch >= 2.10)
    result: torch.Tensor = torch.nn.functional.grouped_mm(x, weight, offs=offs)
    return result


def _grouped_mm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``_grouped_mm(x, weight, offs)`` for ``x`` and ``weight``, by torch."""
    with torch.enable_grad():
        x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
        out = _grouped_mm(x, weight, offs)
        grad_x, grad_weight = torch.autograd.grad(out, (x, weight), grad)
    return grad_x, grad_weight


def _ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
    reduction: int,
    zero_infinity: bool,
) -> torch.Tensor:
    loss: torch.Tensor = torch.ops.aten.ctc_loss.Tensor(
        log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity
    )
    return loss


def _ctc_loss_backward(grad: torch.Tensor, log_probs: torch.Tensor, *rest: Any) -> torch.Tensor:
    """The gradient of :func:`_ctc_loss` for ``log_probs``, by torch."""
    with torch.enable_grad():
        log_probs = log_probs.detach().requires_grad_()
        (grad_log_probs,) = torch.autograd.grad(_ctc_loss(log_probs, *rest), (log_probs,), grad)
    return grad_log_probs


def _index_add(
    source: torch.Tensor, shape: torch.Tensor, index: torch.Tensor, dim: int, alpha: float
) -> torch.Tensor:
    """``zeros(shape).index_add(dim, index, source, alpha=alpha)``; the graph adds the base
    tensor itself (an ``Add``), so ``source`` is the only differentiable input (ORT's ATen
    kernel fails on a gradient node with an unrequested output)."""
    zeros = torch.zeros(tuple(shape.tolist()), dtype=source.dtype, device=source.device)
    return zeros.index_add(dim, index, source, alpha=alpha)


def _index_add_backward(
    grad: torch.Tensor,
    source: torch.Tensor,
    shape: torch.Tensor,
    index: torch.Tensor,
    dim: int,
    alpha: float,
) -> torch.Tensor:
    """Gradient of :func:`_index_add` for ``source``: the gradient's rows at ``index``, times
    ``alpha``."""
    return grad.index_select(dim, index).reshape(source.shape) * alpha


def _log_softmax_backward(grad: torch.Tensor, output: torch.Tensor, dim: int) -> torch.Tensor:
    """torch's fused log-softmax gradient (``passes.log_softmax_grad_in_torch``)."""
    result: torch.Tensor = torch.ops.aten._log_softmax_backward_data(grad, output, dim, grad.dtype)
    return result


# Rows of a cross-entropy's scores handled at once: about 1 MB, so a chunk's log-softmax or
# softmax stays in cache and no temporary of the whole [N, C] is made.
_CHUNK_BYTES: Final = 1 << 20
_NONE, _MEAN, _SUM = 0, 1, 2  # torch's reduction enum


def _rows(scores: torch.Tensor) -> int:
    return max(1, _CHUNK_BYTES // max(1, scores.shape[-1] * scores.element_size()))


def _targets(
    scores: torch.Tensor, labels: torch.Tensor, ignore_index: int, ignores: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels as row indices (ignored ones as 0) and the mask of rows that count; raises
    PyTorch's IndexError for a counted label outside ``[0, C)``."""
    flat = labels.reshape(-1).long()
    valid = flat != ignore_index if ignores else torch.ones_like(flat, dtype=torch.bool)
    index = flat.where(valid, 0)
    outside = valid & ((flat < 0) | (flat >= scores.shape[-1]))
    if bool(outside.any()):
        raise IndexError(f"Target {int(flat[outside][0])} is out of bounds.")
    return index, valid


def _cross_entropy(
    scores: torch.Tensor, labels: torch.Tensor, ignore_index: int, ignores: bool, reduction: int
) -> torch.Tensor:
    """``F.cross_entropy`` of float scores ``[N, C]`` (or ``[C]``) by torch's log-softmax kernel,
    a chunk of rows at a time into one small buffer: the log-probabilities are never kept
    (``passes.cross_entropy_in_torch``)."""
    flat = scores.reshape(-1, scores.shape[-1])
    index, valid = _targets(flat, labels, ignore_index, ignores)
    step = _rows(flat)
    chunk = torch.empty((min(step, flat.shape[0]), flat.shape[1]), dtype=flat.dtype)
    picked = torch.empty((flat.shape[0], 1), dtype=flat.dtype)
    for start in range(0, flat.shape[0], step):
        rows = flat[start : start + step]
        log_probs = chunk[: rows.shape[0]]
        torch.ops.aten._log_softmax.out(rows, 1, False, out=log_probs)
        torch.gather(
            log_probs, 1, index[start : start + step, None], out=picked[start : start + step]
        )
    nll = picked.squeeze(1).neg().where(valid, 0.0)
    if reduction == _NONE:
        return nll.reshape(labels.shape)
    total = nll.sum()
    return total / valid.sum() if reduction == _MEAN else total


def _cross_entropy_backward(
    grad: torch.Tensor,
    scores: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    ignores: bool,
    reduction: int,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of :func:`_cross_entropy` for the scores: ``softmax - one_hot`` times each
    row's weight, the softmax recomputed from the scores by torch's kernel, chunk by chunk into
    the one output buffer; plus ``extra`` (a gradient fed for the scores, of their size or a
    scalar, ``passes.cross_entropy_grads_summed``)."""
    flat = scores.reshape(-1, scores.shape[-1])
    index, valid = _targets(flat, labels, ignore_index, ignores)
    if reduction == _NONE:
        weight = grad.reshape(-1).where(valid, 0.0)
    else:  # rows that do not count get 0, also when none counts (torch's nll_loss_backward)
        weight = (grad / valid.sum() if reduction == _MEAN else grad).expand(valid.shape)
        weight = weight.where(valid, 0.0)
    if extra is not None and extra.numel() == 1:
        # an unused output's zero adds nothing; another scalar adds to every element
        extra = None if float(extra) == 0.0 else extra.reshape(())
    elif extra is not None:
        extra = extra.reshape(flat.shape)
    out = torch.empty_like(flat)
    step = _rows(flat)
    for start in range(0, flat.shape[0], step):
        chunk = out[start : start + step]
        torch.ops.aten._softmax.out(flat[start : start + step], 1, False, out=chunk)
        chunk.mul_(weight[start : start + step, None])
        if extra is not None:
            chunk.add_(extra if extra.dim() == 0 else extra[start : start + step])
    out.scatter_add_(1, index[:, None], -weight[:, None])
    return out.reshape(scores.shape)


GELU_APPROXIMATIONS: Final = ("none", "tanh")  # the int argument of ortfx_gelu


def _gelu(x: torch.Tensor, approximate: int) -> torch.Tensor:
    """torch's fused GELU (``passes.tanh_gelu_in_torch``)."""
    mode = GELU_APPROXIMATIONS[approximate]
    return torch.nn.functional.gelu(x, approximate=mode)


def _gelu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: int) -> torch.Tensor:
    """torch's fused GELU gradient."""
    mode = GELU_APPROXIMATIONS[approximate]
    result: torch.Tensor = torch.ops.aten.gelu_backward(grad, x, approximate=mode)
    return result


_CTC: Final = ("tensor", "tensor", "tensor", "tensor", "int", "int", "bool")
_INDEX_ADD: Final = ("tensor", "tensor", "tensor", "int", "float")
_CROSS_ENTROPY: Final = ("tensor", "tensor", "int", "bool", "int")

# (operator, overload name) -> how to run it
ROUTED: Final[dict[tuple[str, str], Routed]] = {
    # transformers' grouped-mm MoE experts count tokens per expert with it (Mixtral, Qwen2-MoE)
    ("histc", ""): Routed(torch.histc, ("tensor", "int", "float", "float")),
    # ... and multiply each expert's tokens by its weights with it
    ("_grouped_mm", ""): Routed(_grouped_mm, ("tensor", "tensor", "tensor")),
    ("_grouped_mm_backward", ""): Routed(_grouped_mm_backward, ("tensor",) * 4, outputs=2),
    # CTC loss (wav2vec2 and other CTC heads)
    ("ctc_loss", ""): Routed(_ctc_loss, _CTC),
    ("ctc_loss_backward", ""): Routed(_ctc_loss_backward, ("tensor", *_CTC)),
    # tensor.detach(): a copy (ORT assumes an op's output is a buffer of its own) whose input
    # edge ORT's gradient builder never crosses (STOP_GRADIENT)
    ("detach", ""): Routed(torch.clone, ("tensor",)),
    # ORT's ReluGrad is a scalar loop, 30-50x slower than torch's kernel (gradient-model pass)
    ("threshold_backward", ""): Routed(
        torch.ops.aten.threshold_backward, ("tensor", "tensor", "float")
    ),
    # ORT's LogSoftmaxGrad kernel is about twice as slow as torch's (gradient-model pass)
    ("_log_softmax_backward_data", ""): Routed(_log_softmax_backward, ("tensor", "tensor", "int")),
    # index_add with repeated indices: ONNX ScatterND writes, torch adds
    ("index_add", ""): Routed(_index_add, _INDEX_ADD),
    ("index_add_backward", ""): Routed(_index_add_backward, ("tensor", *_INDEX_ADD)),
    # GELU by torch's fused kernels, forward and gradient (passes.tanh_gelu_in_torch)
    ("ortfx_gelu", ""): Routed(_gelu, ("tensor", "int")),
    ("ortfx_gelu_backward", ""): Routed(_gelu_backward, ("tensor", "tensor", "int")),
    # float32 cross-entropy without a log-softmax table (forward pass, cross_entropy_in_torch)
    ("ortfx_cross_entropy", ""): Routed(_cross_entropy, _CROSS_ENTROPY),
    ("ortfx_cross_entropy_backward", ""): Routed(
        _cross_entropy_backward, ("tensor", *_CROSS_ENTROPY)
    ),
    # ... with another gradient of the scores added in (cross_entropy_grads_summed)
    ("ortfx_cross_entropy_backward_plus", ""): Routed(
        _cross_entropy_backward, ("tensor", *_CROSS_ENTROPY, "tensor")
    ),
}

# The gradient of each differentiable routed op, as ORT's gradient registry takes it: nodes of
# (op type, domain, inputs, outputs, attributes); GO(i)/I(i)/GI(i) name the forward node's
# output gradients, inputs and input gradients.
GRADIENTS: Final[dict[str, list[tuple[str, str, list[str], list[str], dict[str, str]]]]] = {
    "_grouped_mm": [
        (
            "ATen",
            "org.pytorch.aten",
            ["GO(0)", "I(0)", "I(1)", "I(2)"],
            ["GI(0)", "GI(1)"],
            {"operator": "_grouped_mm_backward"},
        )
    ],
    "ctc_loss": [
        (
            "ATen",
            "org.pytorch.aten",
            ["GO(0)", *(f"I({i})" for i in range(7))],
            ["GI(0)"],
            {"operator": "ctc_loss_backward"},
        )
    ],
    "index_add": [
        (
            "ATen",
            "org.pytorch.aten",
            ["GO(0)", *(f"I({i})" for i in range(5))],
            ["GI(0)"],
            {"operator": "index_add_backward"},
        )
    ],
    "ortfx_gelu": [
        (
            "ATen",
            "org.pytorch.aten",
            ["GO(0)", "I(0)", "I(1)"],
            ["GI(0)"],
            {"operator": "ortfx_gelu_backward"},
        )
    ],
    "ortfx_cross_entropy": [
        (
            "ATen",
            "org.pytorch.aten",
            ["GO(0)", *(f"I({i})" for i in range(5))],
            ["GI(0)"],
            {"operator": "ortfx_cross_entropy_backward"},
        )
    ],
}

# Gradients ORT 1.19 lacks for standard ONNX ops, in the same form; an attribute given as a
# (value, dtype, is_tensor) triple is typed (a constant of the input's element type).
STANDARD_GRADIENTS: Final[
    dict[str, list[tuple[str, str, list[str], list[str], dict[str, Any]]]]
] = {
    # d atan(x) = dy / (1 + x * x): torch.atan, and torch.atan2 as ortfx exports it
    "Atan": [
        ("Constant", "", [], ["one"], {"value": (1.0, "IElemType(0)", True)}),
        ("Mul", "", ["I(0)", "I(0)"], ["square"], {}),
        ("Add", "", ["square", "one"], ["denominator"], {}),
        ("Div", "", ["GO(0)", "denominator"], ["GI(0)"], {}),
    ],
}

DETACH_NEEDS_BRIDGE = (
    "the forward calls .detach() on a floating tensor; ortfx keeps it from ONNX Runtime's "
    "gradient with an ATen node run by its compiled bridge (ortfx._bridge), which could not "
    "be loaded. Reinstall ortfx with a C++ compiler available (`pip install -e .`), or let "
    "ortfx fall back to PyTorch."
)

# Inputs of routed ops that gradients never flow through (ORT's gradient builder stops there).
STOP_GRADIENT: Final[dict[str, tuple[int, ...]]] = {"detach": (0,)}

_SCALARS: Final[dict[str, Callable[[Any], Any]]] = {"int": int, "float": float, "bool": bool}


def is_tensor_argument(op: str, overload: str, index: int, is_input: bool) -> bool:
    """ORT's question: is argument (or output) ``index`` of ``aten::op.overload`` a tensor?"""
    if not is_input:
        return True
    return ROUTED[(op, overload)].arguments[index] == "tensor"


def execute(op: str, overload: str, inputs: Sequence[Any], n_out: int) -> list[Any]:
    """Run ``aten::op.overload`` on DLPack capsules; return one capsule per output."""
    routed = ROUTED[(op, overload)]
    args = []
    for kind, capsule in zip(routed.arguments, inputs, strict=True):
        value = None if capsule is None else torch.utils.dlpack.from_dlpack(capsule)
        if value is not None and kind in _SCALARS:
            value = _SCALARS[kind](value.item())
        args.append(value)
    result = routed.function(*args)
    outputs = result if isinstance(result, tuple) else (result,)
    if len(outputs) != n_out:
        raise RuntimeError(f"aten::{op} returned {len(outputs)} outputs, ORT expects {n_out}")
    to_dlpack: Any = torch.utils.dlpack.to_dlpack  # type: ignore[attr-defined]
    capsules = [to_dlpack(t.contiguous()) for t in outputs]
    openmp.after_callback()
    return capsules


_installed: list[bool] = []
_lock = threading.Lock()


def install() -> bool:
    """Register the executor with ORT once per process; False without the bridge."""
    with _lock:
        if _installed:
            return _installed[0]
        try:
            from onnxruntime.capi import _pybind_state as C

            from ortfx import _bridge  # type: ignore[attr-defined]
        except ImportError:
            _installed.append(False)
            return False
        _bridge.set_aten_executor(is_tensor_argument, execute)
        is_tensor, run = _bridge.aten_addresses()
        C.register_aten_op_executor(str(is_tensor), str(run))
        for op, nodes in GRADIENTS.items():
            C.register_gradient_definition(f"{DOMAIN}::ATen::{op}::", _gradient_nodes(C, nodes))
        for op, edges in STOP_GRADIENT.items():
            C.register_custom_stop_gradient_edges(f"{DOMAIN}::ATen::{op}::", set(edges))
        _installed.append(True)
        return True


_standard: list[bool] = []


def install_standard_gradients() -> None:
    """Register :data:`STANDARD_GRADIENTS` with ORT's training layer once per process (no
    bridge needed); before any gradient build."""
    with _lock:
        if _standard:
            return
        from onnxruntime.capi import _pybind_state as C

        for op, nodes in STANDARD_GRADIENTS.items():
            C.register_gradient_definition(f"::{op}", _gradient_nodes(C, nodes))
        _standard.append(True)


def _gradient_nodes(
    C: Any, nodes: Sequence[tuple[str, str, list[str], list[str], Mapping[str, Any]]]
) -> Any:
    defined = []
    for op_type, domain, inputs, outputs, attributes in nodes:
        node = C.GradientNodeDefinition()
        node.op_type, node.domain, node.inputs, node.outputs = op_type, domain, inputs, outputs
        node_attributes = []
        for name, spec in attributes.items():
            value, dtype, is_tensor = spec if isinstance(spec, tuple) else (spec, "string", False)
            attribute = C.GradientNodeAttributeDefinition()
            attribute.name, attribute.value_json, attribute.dtype = name, json.dumps(value), dtype
            attribute.is_tensor = is_tensor
            node_attributes.append(attribute)
        node.attributes = node_attributes
        defined.append(node)
    return defined


def routed_ops(model: bytes, /) -> tuple[str, ...]:
    """The ops an exported graph runs in torch (its ATen nodes), sorted, for the log."""
    graph = onnx.load_model_from_string(model).graph
    return tuple(
        sorted(
            {
                f"aten::{onnx.helper.get_attribute_value(a).decode()}"
                for n in graph.node
                if n.op_type == "ATen" and n.domain == DOMAIN
                for a in n.attribute
                if a.name == "operator"
            }
        )
    )
