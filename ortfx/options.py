"""Every setting of ortfx in one frozen record; the export-relevant subset feeds the export key.

Settings come from the constructor (``Options``, upstream-style ``DebugOptions``) and from the
environment (upstream's ``ORTMODULE_*`` names and ortfx's own ``ORTFX_*``); the environment wins.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

import attrs

Exporter: TypeAlias = Literal["auto", "torchscript", "dynamo"]


class LogLevel(enum.IntEnum):
    """Upstream's levels, mapped onto the standard ``logging`` levels."""

    VERBOSE = 5
    DEVINFO = 15
    INFO = 20
    WARNING = 30
    ERROR = 40
    FATAL = 50


class FallbackPolicy(enum.IntFlag):
    """When ortfx runs the module in plain PyTorch instead of failing. Combine with ``|``."""

    DISABLE = 1
    UNSUPPORTED_DEVICE = 8
    UNSUPPORTED_DATA = 16
    UNSUPPORTED_TORCH_MODEL = 32
    UNSUPPORTED_ONNX_MODEL = 64
    BAD_INITIALIZATION = 128

    def allows(self, flag: FallbackPolicy) -> bool:
        return FallbackPolicy.DISABLE not in self and flag in self


DEFAULT_FALLBACK = (
    FallbackPolicy.UNSUPPORTED_DEVICE
    | FallbackPolicy.UNSUPPORTED_DATA
    | FallbackPolicy.UNSUPPORTED_TORCH_MODEL
    | FallbackPolicy.UNSUPPORTED_ONNX_MODEL
)


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"'{attribute.name}' must be a positive int (got {value!r}).")


# The opsets ORT 1.19's training layer builds gradients for, with the TorchScript exporter:
# below 12 Dropout has no training_mode input (the gradient build rejects it); above 21 ORT 1.19
# has no schemas. Some torch ops need more (tril needs 14), which the exporter says by name.
MIN_OPSET, MAX_OPSET = 12, 21
OPSET_RANGE = f"an int from {MIN_OPSET} to {MAX_OPSET}"


def _opset(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or not MIN_OPSET <= value <= MAX_OPSET:
        raise ValueError(
            f"'{attribute.name}' must be {OPSET_RANGE}, the opsets ORT 1.19 trains (got {value!r})."
        )


def _one_of(*choices: object) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices:
            raise ValueError(
                f"'{attribute.name}' must be one of {', '.join(map(repr, choices))} "
                f"(got {value!r})."
            )

    return check


def _str_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (tuple, list, set, frozenset)) or not all(
        isinstance(v, str) for v in value
    ):
        raise TypeError(
            "'dynamic_scalars' must be a tuple of leaf paths such as ('args[1]',) or ('*',) "
            f"(got {value!r})."
        )
    return tuple(sorted(value))


def _log_level(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, LogLevel):
        raise TypeError(
            f"'{attribute.name}' must be an ortfx.LogLevel (got {value!r} that is a "
            f"{type(value).__name__}); use e.g. ortfx.LogLevel.INFO."
        )


def _prefix(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"'{attribute.name}' must be a str (got {value!r} that is a {type(value).__name__}); "
            "it starts the names of the saved ONNX files."
        )


def _memory_config(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"'{attribute.name}' must be a str (got {value!r}).")
    from ortfx.memory import parse_config

    parse_config(value)  # raises ValueError naming the malformed entry


def _cache_dir(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"'{attribute.name}' must be a str (got {value!r} that is a {type(value).__name__}); "
            "a directory for the persistent export cache, or '' for none."
        )
    if value and os.path.exists(value) and not os.path.isdir(value):
        raise ValueError(f"'{attribute.name}' must be a directory (got {value!r}, a file).")


SAVE_PATH_NOT_WRITABLE = (
    "cannot save ONNX models to {directory!r}: it {problem}. Pass an existing, writable "
    "directory as DebugOptions(save_path=...) or ORTMODULE_SAVE_ONNX_PATH (or create it first)."
)


def _unwritable(directory: str) -> str | None:
    """Why ``directory`` cannot take saved models, or None if it can."""
    if not os.path.exists(directory):
        return "does not exist"
    if not os.path.isdir(directory):
        return "is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "is not writable"
    return None


@attrs.frozen
class ExportOptions:
    """The options that change the exported or processed graph; part of the export key."""

    exporter: str
    opset_version: int
    enable_compute_optimizer: bool = True
    enable_custom_autograd_function: bool = True
    strict_tracing: bool = False


@attrs.frozen(kw_only=True)
class Options:
    """All ortfx settings. Construct directly or with :meth:`from_env`; change with ``evolve``."""

    exporter: Exporter = attrs.field(
        default="auto", validator=_one_of("auto", "torchscript", "dynamo")
    )
    opset_version: int = attrs.field(default=17, validator=_opset)
    # Python scalars at these leaf paths ("args[1]", "kwargs['scale']", or "*" for every int and
    # float) are fed to the graph as 0-dim tensors instead of being baked in as constants.
    dynamic_scalars: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    cache_size: int = attrs.field(default=8, validator=_positive)
    enable_compute_optimizer: bool = True
    # Run custom torch.autograd.Functions inside the ORT graph (PythonOp); when off, a module
    # that calls one raises (or falls back per policy) instead of inlining it.
    enable_custom_autograd_function: bool = True
    # Refuse a graph into which the tracer baked a Python value computed from a tensor (a branch
    # on tensor values or sizes, an int taken from a size): an OrtfxExportError, so the fallback
    # policy runs such a module in PyTorch instead of a graph that stops checking.
    strict_tracing: bool = False
    # Export from a deep copy, for modules whose forward mutates their own state.
    deepcopy_before_export: bool = False
    memory_opt_level: int = attrs.field(default=0, validator=_one_of(0, 1, 2))
    # A JSON file of plan strings or inline "Gelu+:1:-1,FusedMatMul+:1:12"; see ortfx.memory.
    memory_opt_config: str = attrs.field(default="", validator=_memory_config)
    fallback_policy: FallbackPolicy = DEFAULT_FALLBACK
    # After a fallback, try ORT again when a new input schema arrives.
    fallback_retry: bool = True
    log_level: LogLevel = attrs.field(default=LogLevel.WARNING, validator=_log_level)
    save_onnx: bool = False
    onnx_prefix: str = attrs.field(default="", validator=_prefix)
    save_path: str = ""
    # A directory for processed graphs kept across processes (see ortfx.runtime.disk_cache);
    # "" turns the persistent cache off. Created on first store.
    cache_dir: str = attrs.field(default="", validator=_cache_dir)
    # None follows torch.get_num_threads() at session creation.
    intra_op_threads: int | None = None
    # ORT's spinning thread pool burns cores while idle; on shared machines it hurts badly.
    allow_spinning: bool = False
    # Release torch's idle OpenMP threads while ORT runs: after each parallel torch op they spin
    # for milliseconds on the cores ORT's threads need (ortfx.runtime.openmp).
    release_torch_threads: bool = True
    # ORT's CPU memory arena keeps its high-water mark: faster steps, but it hides what the
    # memory optimizer saves. Turn it off to see (and keep) the savings in RSS.
    cpu_mem_arena: bool = True
    # Each trainable parameter enters the graph through a PythonOp whose backward hands its
    # gradient to torch (AccumulateGrad, hooks, DDP) the moment ORT computes it, instead of
    # all gradients at the end of ORT's backward. See docs/memory.md.
    enable_mem_efficient_grad_management: bool = False
    # DeepSpeed ZeRO-3 phase 2 (set by configure_ort_compatible_zero_stage3(), layerwise by default,
    # with enable_mem_efficient_grad_management): each parameter feed waits for its layer's
    # input, and backward nodes read a re-gathered copy. See docs/zero3.md.
    zero3_layerwise: bool = False

    def __attrs_post_init__(self) -> None:
        if self.save_onnx and not self.onnx_prefix:
            raise ValueError(
                "save_onnx=True needs a non-empty onnx_prefix: the saved files are named "
                "'{prefix}_torch_exported_{mode}.onnx' and so on. Pass e.g. "
                "DebugOptions(save_onnx=True, onnx_prefix='my_model')."
            )
        # A directory given explicitly is checked even before saving is turned on: a typo
        # should fail here, not after a long run that was meant to leave models behind.
        directory = self.save_path or (os.getcwd() if self.save_onnx else "")
        problem = _unwritable(directory) if directory else None
        if problem:
            raise OSError(SAVE_PATH_NOT_WRITABLE.format(directory=directory, problem=problem))

    def export_options(self, resolved_exporter: str) -> ExportOptions:
        """The export-relevant subset, with ``"auto"`` already resolved to a real exporter."""
        return ExportOptions(
            resolved_exporter,
            self.opset_version,
            self.enable_compute_optimizer,
            self.enable_custom_autograd_function,
            self.strict_tracing,
        )

    @classmethod
    def from_env(
        cls, base: Options | None = None, environ: Mapping[str, str] | None = None
    ) -> Options:
        """``base`` (default: defaults) with every set environment variable applied on top.

        An invalid value warns once, naming the variable, the value and the valid choices, and
        keeps the value from ``base``. A save directory that cannot be written raises
        ``OSError``, as upstream: models asked for must not silently go unsaved.
        """
        base = base if base is not None else cls()
        env = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        for variable, (field, parse, choices) in ENVIRONMENT.items():
            raw = env.get(variable)
            if raw is None:
                continue
            try:
                value = parse(raw)
                attrs.evolve(base, **{**changes, field: value})  # run the validators
            except OSError as e:
                raise OSError(f"{variable}={raw!r}: {e}") from None
            except (ValueError, TypeError, KeyError) as e:
                # choices=None: the validator's own message says what was expected.
                reason = str(e).rstrip(".") if choices is None else f"expected {choices}"
                _warn_invalid(variable, raw, reason)
                continue
            changes[field] = value
        return attrs.evolve(base, **changes) if changes else base


class DebugOptions:
    """Upstream's debug settings: log level and saving the ONNX models of each stage.

    ``DebugOptions(log_level=LogLevel.WARNING, save_onnx=False, onnx_prefix="", save_path="")``;
    validated on construction (see :class:`Options`). Passed to ``ORTModule(model, debug_options)``.
    """

    def __init__(
        self,
        log_level: LogLevel = LogLevel.WARNING,
        save_onnx: bool = False,
        onnx_prefix: str = "",
        save_path: str = "",
    ) -> None:
        self.options = Options(
            log_level=log_level, save_onnx=save_onnx, onnx_prefix=onnx_prefix, save_path=save_path
        )

    def apply(self, options: Options) -> Options:
        o = self.options
        return attrs.evolve(
            options,
            log_level=o.log_level,
            save_onnx=o.save_onnx,
            onnx_prefix=o.onnx_prefix,
            save_path=o.save_path,
        )


def _flag(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _fallback(raw: str) -> FallbackPolicy:
    policy = FallbackPolicy(0)
    for name in raw.replace(",", "|").split("|"):
        policy |= FallbackPolicy[name.strip().upper().removeprefix("FALLBACK_")]
    if not policy:
        raise ValueError(raw)
    return policy


def _threads(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError(raw)
    return value


_FALLBACK_NAMES = " | ".join(f"FALLBACK_{f.name}" for f in FallbackPolicy if f.name)

# variable -> (Options field, parser, valid choices for the warning, or None to quote the validator)
ENVIRONMENT: dict[str, tuple[str, Callable[[str], Any], str | None]] = {
    "ORTMODULE_LOG_LEVEL": (
        "log_level",
        lambda r: LogLevel[r.strip().upper()],
        ", ".join(LogLevel.__members__),
    ),
    "ORTMODULE_SAVE_ONNX_PATH": ("save_path", str, "a writable directory"),
    "ORTMODULE_FALLBACK_POLICY": ("fallback_policy", _fallback, _FALLBACK_NAMES + " (joined by |)"),
    "ORTMODULE_FALLBACK_RETRY": ("fallback_retry", _flag, "1/0, true/false"),
    "ORTMODULE_ONNX_OPSET_VERSION": ("opset_version", int, OPSET_RANGE),
    "ORTMODULE_MEMORY_OPT_LEVEL": ("memory_opt_level", int, "0, 1 or 2"),
    "ORTMODULE_MEMORY_OPT_CONFIG": ("memory_opt_config", str, None),
    "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": ("enable_compute_optimizer", _flag, "1 or 0"),
    "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": ("enable_custom_autograd_function", _flag, "1 or 0"),
    "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT": ("deepcopy_before_export", _flag, "1 or 0"),
    "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": (
        "enable_mem_efficient_grad_management",
        _flag,
        "1 or 0",
    ),
    "ORTMODULE_CACHE_DIR": ("cache_dir", str.strip, None),
    "ORTFX_EXPORTER": ("exporter", str.strip, "auto, torchscript, dynamo"),
    "ORTFX_INTRA_OP_THREADS": ("intra_op_threads", _threads, "a positive int"),
    "ORTFX_ALLOW_SPINNING": ("allow_spinning", _flag, "1 or 0"),
    "ORTFX_RELEASE_TORCH_THREADS": ("release_torch_threads", _flag, "1 or 0"),
    "ORTFX_CPU_MEM_ARENA": ("cpu_mem_arena", _flag, "1 or 0"),
    "ORTFX_STRICT_TRACING": ("strict_tracing", _flag, "1 or 0"),
}

_warned: set[tuple[str, str]] = set()


def _warn_invalid(variable: str, raw: str, reason: str) -> None:
    from ortfx.errors import OrtfxWarning

    if (variable, raw) in _warned:
        return
    _warned.add((variable, raw))
    warnings.warn(
        f"ignoring {variable}={raw!r}: {reason}; keeping the default.",
        OrtfxWarning,
        stacklevel=3,
    )
