"""The pure core's records: a call's keys (export, gradient, session), the decision types, the
reasons they carry, and what the cache holds per entry. Frozen, compared by value."""

from __future__ import annotations

import functools
from typing import Any, Generic, TypeAlias, TypeVar

import attrs

from ortfx.options import ExportOptions
from ortfx.schema import ModelSchema

P = TypeVar("P")

# (where, canonical value) per guard of a graph, in trace order (see model_info.Guard)
Baked: TypeAlias = tuple[tuple[str, Any], ...]


@attrs.frozen
class Reason:
    """One difference between what a cache entry was built for and the current call."""

    path: str
    seen: str
    given: str
    why: str

    def __str__(self) -> str:
        return f"{self.path} was {self.seen}, now {self.given} ({self.why})"


@attrs.frozen
class ModuleVersion:
    """Bumped by every change to the module that can change its graph; ``cause`` says which."""

    number: int = 0
    cause: str = attrs.field(default="", eq=False)


@attrs.frozen
class ExportKey:
    """Everything that can change the exported graph, and nothing that cannot."""

    schema: ModelSchema
    training: bool
    module_version: ModuleVersion
    options: ExportOptions
    versions: tuple[str, str]  # (torch, onnx)
    # None: the graph does not depend on grad mode. Else the grad mode it was traced for: the
    # module asked torch.is_grad_enabled() while traced (see :func:`resolve`).
    grad_mode: bool | None = None
    # None: the graph does not depend on requires_grad flags. Else the (inputs, parameters)
    # flags it was traced for: the forward read requires_grad of an input or a parameter.
    grad_flags: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None
    # Submodules whose train/eval flag differs from the root's ``training`` (a frozen
    # BatchNorm: ``model.bn.eval()``), by name: the trace follows each module's own flag.
    other_mode: tuple[str, ...] = ()
    # The dtype torch.autocast runs the call's device in ("bfloat16"), or None when off: the
    # trace records its casts, so a graph traced without them computes in another dtype.
    autocast: str | None = None
    # torch.get_default_dtype(): the dtype of the tensors the forward creates without one.
    default_dtype: str = "float32"
    # None: the trace took no Python value from traced tensors. Else the values it baked in,
    # ``(where, value)`` per guard (see model_info.Guard): the graph serves only calls that
    # give the same ones, which each run checks.
    baked: Baked | None = None


@attrs.frozen
class GradState:
    """Which inputs and parameters require grad: decides re-processing, not re-export."""

    inputs: tuple[bool, ...]
    params: tuple[bool, ...]
    param_names: tuple[str, ...] = attrs.field(eq=False)
    # (memory_opt_level, memory_opt_config): the gradient graph's recompute plans.
    memory: tuple[int, str] = (0, "")
    # Options.enable_mem_efficient_grad_management: parameters fed through PythonOps.
    mem_efficient_grad: bool = False

    @functools.cached_property
    def any_grad(self) -> bool:
        """Whether any input or parameter requires grad (asked on every call)."""
        return any(self.inputs) or any(self.params)


@attrs.frozen
class SessionKey:
    """What only needs a new ORT session: the device, torch's determinism flag and the
    session settings (``(option name, value)`` pairs: threads, spinning, CPU arena)."""

    device: str
    deterministic: bool
    settings: tuple[tuple[str, Any], ...] = ()


@attrs.frozen
class GuardHint:
    """What a discarded run of a guarded graph told about the call (see model_info.Guard).

    The forward's conversions happen in one order for a given path through its Python code, so
    the graphs traced for one key form a decision tree: a run's guards agree with the call's own
    values up to the first that differed, and that one's value is the call's. ``prefix`` is that
    much (through the first difference); a graph whose guards start with it follows the call's
    path at least one conversion further. ``failed``: the guards of graphs whose run raised for
    this call (a constant that made the graph unable to run it: another length to split into),
    which tell nothing of the call's values.
    """

    prefix: Baked = ()
    failed: tuple[Baked, ...] = ()


@attrs.frozen
class Call:
    """Everything :func:`decide` needs to know about one forward call."""

    key: ExportKey
    grad: GradState
    session: SessionKey
    grad_enabled: bool = False  # torch.is_grad_enabled() at the call
    # Set when a run of this call with a guarded graph was discarded: which graph to try next.
    hint: GuardHint | None = None


@attrs.frozen
class Reuse:
    pass


@attrs.frozen
class NewSession:
    reasons: tuple[Reason, ...]


@attrs.frozen
class Reprocess:
    reasons: tuple[Reason, ...]


@attrs.frozen
class Reexport:
    reasons: tuple[Reason, ...]


Decision: TypeAlias = Reuse | NewSession | Reprocess | Reexport


def decision_name(decision: Decision, *, first: bool = False) -> str:
    if isinstance(decision, Reexport):
        return "export" if first else "re-export"
    if isinstance(decision, Reprocess):
        return "re-process"
    if isinstance(decision, NewSession):
        return "new session"
    return "reuse"


@attrs.frozen
class Transition:
    """A non-trivial decision in the history, with its reasons; renders as one log line."""

    call: int
    kind: str
    reasons: tuple[Reason, ...]

    def __str__(self) -> str:
        return f"{self.kind}: " + "; ".join(map(str, self.reasons))


@attrs.frozen
class Entry(Generic[P]):
    """One cached graph: what it was built for, and the shell's artifacts for it."""

    key: ExportKey
    grad: GradState
    session: SessionKey
    payload: P = attrs.field(eq=False)
