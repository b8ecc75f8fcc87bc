"""The persistent export cache: processed graphs on disk, keyed by everything the export reads.

``Options(cache_dir=...)`` / ``ORTMODULE_CACHE_DIR``. An entry is what :func:`ortfx.export.export`
and the ``for_export`` passes produce for one export key; a warm start loads it instead of
running the torch exporter. The digest covers the call schema, train/eval, the torch.autocast
dtype, the export options, the module tree (class, class source file, training flag and plain
attribute values of every submodule; name, shape, dtype and requires_grad of every parameter
and buffer), the inputs of the ``for_export`` passes, and the versions of torch, onnx, ORT,
Python and ortfx (its sources included). A module the digest cannot describe safely (a forward
hook, an attribute with no stable text) is not cached, nor is a graph with PythonOps, values
the tracer baked in, or a forward that sets attributes of its modules.

Entries are pickles: the directory must be trusted, as a ``torch.load`` path. Writes go to a
temporary file that replaces the entry atomically; an entry that cannot be read or fails its
checksum is ignored with a WARNING and exported again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import onnx
import torch

from ortfx import io
from ortfx.keys import ExportKey
from ortfx.model_info import PostExportProcessedModelInfo
from ortfx.runtime.logs import WrapperLog

# Bump when the stored record or the digest text changes meaning.
FORMAT = b"ortfx-export-cache 2\n"

CACHE_HIT = "export cache hit: %s (no export)"
CACHE_MISS = "export cache miss: %s (exporting)"
CACHE_STORED = "export cache: stored %s (%d KB)"
CACHE_SKIPPED = "export cache not used: %s"
CACHE_CORRUPT = "export cache: ignoring unreadable entry %s (%s); exporting again"
CACHE_WRITE_FAILED = "export cache: could not store %s (%s); the next start exports again"


@attrs.frozen
class Entry:
    """What one cache file holds."""

    info: PostExportProcessedModelInfo
    checkpoint_calls: int


@attrs.frozen
class Slot:
    """Where the entry for one export key lives, or why the key cannot be cached."""

    path: Path | None
    refused: str = ""


class Uncacheable(Exception):
    """The digest cannot describe the module safely; the text says why."""


# ---- the digest --------------------------------------------------------------------------------


@functools.cache
def _ortfx_sources() -> str:
    """Digest of ortfx's own sources: a development checkout changes without a version bump."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.glob("*.cpp")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _ortfx_version() -> str:
    try:
        return importlib.metadata.version("ortfx")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def _file_digest(filename: str) -> str:
    try:
        return hashlib.sha256(Path(filename).read_bytes()).hexdigest()
    except OSError as e:
        raise Uncacheable(f"cannot read the source file {filename} ({e.strerror})") from None


def _code_of(obj: Any) -> str:
    """A class's or function's qualified name and the digest of the file that defines it;
    torch's own code is covered by torch's version."""
    name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
    if name.startswith("torch."):
        return name
    try:
        filename = inspect.getsourcefile(obj)
    except TypeError:
        filename = None
    if filename is None:
        raise Uncacheable(f"{name} has no source file to key on")
    return f"{name}@{_file_digest(filename)}"


_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _value_text(where: str, value: Any) -> str:
    """A stable text for an attribute the forward may read; raises when there is none."""
    if isinstance(value, _PLAIN):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list, frozenset, set)):
        items = [_value_text(where, v) for v in value]
        if isinstance(value, (set, frozenset)):
            items = sorted(items)
        return f"{type(value).__name__}({', '.join(items)})"
    if isinstance(value, dict):
        items = [f"{k!r}: {_value_text(where, v)}" for k, v in value.items()]
        return "{" + ", ".join(items) + "}"
    if isinstance(value, torch.Tensor):  # a plain tensor attribute is baked in as a constant
        data = value.detach().cpu().contiguous()
        h = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        return f"tensor({data.dtype}, {tuple(data.shape)}, {h.hexdigest()})"
    if inspect.isfunction(value) or inspect.isclass(value) or inspect.ismethod(value):
        return _code_of(value)
    text = repr(value)
    if " at 0x" in text or " object at " in text:
        raise Uncacheable(f"{where} is a {type(value).__qualname__} without a stable description")
    return f"{_code_of(type(value))}:{text}"


def _module_lines(module: torch.nn.Module) -> Iterator[str]:
    from ortfx._torch import hook_tables

    if any(hook_tables(None)[:2]):  # forward pre-hooks, forward hooks
        raise Uncacheable("a global forward hook is registered")
    for name, sub in module.named_modules(remove_duplicate=False):
        where = name or "<root>"
        if any(hook_tables(sub)[:2]):
            raise Uncacheable(f"{where} has forward hooks")
        yield f"module {where}: {_code_of(type(sub))} training={sub.training}"
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or key == "training":
                continue  # torch's own bookkeeping (parameters, buffers, hooks, ...)
            yield f"  {key} = {_value_text(f'{where}.{key}', value)}"
    for name, p in module.named_parameters(remove_duplicate=False):
        yield f"param {name}: {p.dtype} {tuple(p.shape)} requires_grad={p.requires_grad}"
    for name, b in module.named_buffers(remove_duplicate=False):
        yield f"buffer {name}: {b.dtype} {tuple(b.shape)}"


def key_text(
    module: torch.nn.Module,
    key: ExportKey,
    padding: Mapping[str, int],
    dynamic_scalars: frozenset[str],
) -> str:
    """Everything the export and the ``for_export`` passes read, as text (the digest's input).
    Raises :class:`Uncacheable` when part of it has no stable text."""
    treespec = repr(key.schema.treespec)
    if " at 0x" in treespec:
        raise Uncacheable("the input tree holds a node without a stable description")
    lines = [
        FORMAT.decode().strip(),
        f"versions: torch {torch.__version__}, onnx {onnx.__version__}, "
        f"onnxruntime {_ort_version()}, python {sys.version.split()[0]}, "
        f"ortfx {_ortfx_version()} sources {_ortfx_sources()}",
        f"mode: {'training' if key.training else 'eval'}",
        f"autocast: {key.autocast or 'off'}",
        f"options: {key.options!r}",
        f"default dtype: {torch.get_default_dtype()}",
        f"schema: {treespec} {key.schema.leaves!r}",
        f"embedding padding: {sorted(padding.items())!r}",
        f"dynamic scalars: {sorted(dynamic_scalars)!r}",
        *_module_lines(module),
    ]
    return "\n".join(lines)


def slot(
    directory: str,
    module: torch.nn.Module,
    key: ExportKey,
    padding: Mapping[str, int],
    dynamic_scalars: frozenset[str],
) -> Slot:
    """The entry's path under ``directory`` for this key (or why there is none)."""
    try:
        text = key_text(module, key, padding, dynamic_scalars)
    except Uncacheable as e:
        return Slot(None, str(e))
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    mode = "train" if key.training else "eval"
    return Slot(Path(directory) / f"{type(module).__name__}-{mode}-{digest}.ortfx")


# ---- reading and writing -----------------------------------------------------------------------


def load(path: Path, log: WrapperLog) -> Entry | None:
    """The entry at ``path``; None when there is none or it cannot be read (with a WARNING)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.log(logging.WARNING, CACHE_CORRUPT, path, e.strerror or type(e).__name__)
        return None
    try:
        header, checksum, payload = data.split(b"\n", 2)
        if header + b"\n" != FORMAT:
            raise ValueError("not an ortfx cache file of this format")
        if hashlib.sha256(payload).hexdigest().encode() != checksum:
            raise ValueError("checksum mismatch")
        # The container types of the call and output specs first: optree unpickles a spec only
        # when its node types are registered in this process.
        types, body = pickle.loads(payload)
        io.register_types(types)
        entry = pickle.loads(body)
        if not isinstance(entry, Entry):
            raise ValueError(f"holds a {type(entry).__name__}")
    except Exception as e:  # any damage at all: re-export instead of failing the call
        log.log(logging.WARNING, CACHE_CORRUPT, path, str(e) or type(e).__name__)
        return None
    return entry


def store(path: Path, entry: Entry, log: WrapperLog) -> None:
    """Write ``entry`` atomically: a reader sees the old file, no file, or the whole new one."""
    body = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    payload = pickle.dumps((io.registered_types(), body), protocol=pickle.HIGHEST_PROTOCOL)
    data = FORMAT + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except OSError as e:
        if temp is not None:
            _unlink(temp)
        log.log(logging.WARNING, CACHE_WRITE_FAILED, path, e.strerror or type(e).__name__)
        return
    log.log(logging.INFO, CACHE_STORED, path, len(data) // 1024)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _ort_version() -> str:
    # Imported here: ortfx imports without onnxruntime (the version only matters with a cache).
    import onnxruntime

    return str(onnxruntime.__version__)
