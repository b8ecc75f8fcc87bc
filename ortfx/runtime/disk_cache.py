"""The persistent export cache: what ortfx builds from a traced graph, kept across processes.

``Options(cache_dir=...)`` / ``ORTMODULE_CACHE_DIR``. Content-addressed, as torch.compile's FX
graph cache is: every process still traces its module (the trace is what says which graph the
current code gives), and the expensive artifacts built from the trace are keyed by what they
are built from:

- the processed graph (the ``for_export`` passes' output) by the traced graph (the ONNX bytes
  :func:`ortfx.export.export` returns and its record: inputs, outputs, the call's and the
  output's structure), the passes' own inputs and the export options;
- ORT's gradient graph of a training session (built by ORT's training layer, then
  ``for_gradient``) by the session's forward graph and everything the build reads
  (:func:`cached_gradient`);

both with the versions of torch, onnx, protobuf, ORT, Python and ortfx (its sources and its
compiled bridge included). A hit cannot serve a graph the current code would not produce:
whatever the forward reads (globals, helper files, closures, private attributes, tied weights)
is in what it traced.

An entry is one file: a format line, a SHA-256 of the rest, one line of JSON (plain data,
decoded into ortfx's own records only) and the ONNX model's bytes. Nothing in it is ever run as
code. A directory that another user owns, or that its group or everyone may write, is refused
with a WARNING (the cache is then off), as ssh and pip refuse such files; so is an entry file
writable by others. Writes go to a temporary file that replaces the entry atomically; an entry
that cannot be read, fails its checksum or was stored for another digest is ignored with a
WARNING and built again.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import onnx
import torch

from ortfx.keys import ExportKey
from ortfx.model_info import (
    Guard,
    InputKind,
    InputSpec,
    PostExportProcessedModelInfo,
    Update,
)
from ortfx.runtime import events
from ortfx.runtime.logs import WrapperLog
from ortfx.schema import ModelSchema

# Bump when an entry's layout or the digest's text changes meaning.
FORMAT = b"ortfx-export-cache 3\n"

CACHE_HIT = "export cache hit: %s (the traced graph's processing skipped)"
CACHE_MISS = "export cache miss: %s (processing the traced graph)"
CACHE_STORED = "export cache: stored %s (%d KB)"
CACHE_SKIPPED = "export cache not used: %s"
GRADIENT_HIT = "export cache hit: %s (ORT's gradient build skipped)"
GRADIENT_MISS = "export cache miss: %s (building ORT's gradient graph)"
GRADIENT_SKIPPED = "export cache: ORT's gradient graph not cached: %s"
CACHE_CORRUPT = "export cache: ignoring unreadable entry %s (%s); building it again"
CACHE_WRITE_FAILED = "export cache: could not store %s (%s); the next start builds it again"
CACHE_UNTRUSTED = (
    "export cache off: the directory %s %s; ortfx reads and writes cache entries only where "
    "no other user can place them (a directory this user owns, chmod go-w)"
)


class Uncacheable(Exception):
    """The traced graph's record has no stable plain-data form; the text says why."""


@attrs.frozen
class Slot:
    """Where the entry for one traced graph lives, and the digest it must carry."""

    path: Path
    digest: str


# ---- the directory: refused unless only this user can write it -------------------------------


def refusal(status: os.stat_result, uid: int) -> str:
    """Why a directory (or entry) with ``status`` must not be trusted by user ``uid``; "" if
    it may be. Pure: tests give it any owner."""
    if status.st_uid != uid:
        return f"is owned by another user (uid {status.st_uid}, this process runs as uid {uid})"
    if status.st_mode & stat.S_IWOTH:
        return f"is writable by every user (mode {stat.filemode(status.st_mode)})"
    if status.st_mode & stat.S_IWGRP:
        return f"is writable by its group (mode {stat.filemode(status.st_mode)})"
    return ""


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def trusted(directory: str, log: WrapperLog, *, create: bool = False) -> bool:
    """Whether ``directory`` may be read and written; once per directory and problem, a
    WARNING says why not. A missing one is created (``create``) for this user alone."""
    path = Path(directory)
    try:
        if create:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = refusal(path.stat(), os.geteuid())
    except FileNotFoundError:
        return True  # nothing to read yet; store() creates it
    except OSError as e:
        problem = f"cannot be used ({e.strerror or type(e).__name__})"
    if not problem:
        return True
    with _warned_lock:
        first = (directory, problem) not in _warned
        _warned.add((directory, problem))
    if first:
        log.log(logging.WARNING, CACHE_UNTRUSTED, directory, problem)
    return False


# ---- the digest --------------------------------------------------------------------------------


@functools.cache
def _ortfx_sources() -> str:
    """Digest of ortfx's own sources (a development checkout changes without a version bump)
    and of its compiled bridge, whose presence decides which kernels graphs run in torch."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.glob("*.cpp"), *root.glob("*.so")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def _versions() -> str:
    # ORT imported here: ortfx imports without onnxruntime (the version matters with a cache).
    import onnxruntime

    return (
        f"torch {torch.__version__}, onnx {onnx.__version__}, protobuf "
        f"{_version('protobuf')}, onnxruntime {onnxruntime.__version__}, python "
        f"{sys.version.split()[0]}, ortfx {_version('ortfx')} sources {_ortfx_sources()}"
    )


# The records an entry's JSON may name, and nothing else: decoding builds only these.
_RECORDS: dict[str, type] = {"Guard": Guard, "InputSpec": InputSpec, "Update": Update}
_ENUMS: dict[str, type[enum.Enum]] = {"InputKind": InputKind}
# Taken from this process's trace, never from an entry: the passes do not change them.
_TRACED_FIELDS = ("input_schema", "output_schema")
# The fields an entry's record holds: all but those and the model's bytes.
_RECORD_FIELDS = frozenset(
    f.name
    for f in attrs.fields(PostExportProcessedModelInfo)
    if f.name != "model" and f.name not in _TRACED_FIELDS
)


def _encode(value: Any) -> Any:
    """Plain JSON data for a field value; raises :class:`Uncacheable` for anything else."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return {"float": repr(value)}  # exact, nan and inf included
    if kind is tuple:
        return [_encode(v) for v in value]
    if kind is frozenset:
        return {"frozenset": sorted((_encode(v) for v in value), key=json.dumps)}
    if _ENUMS.get(kind.__name__) is kind:
        return {"enum": kind.__name__, "name": value.name}
    if _RECORDS.get(kind.__name__) is kind:
        fields = {f.name: _encode(getattr(value, f.name)) for f in attrs.fields(kind)}
        return {"record": kind.__name__, "fields": fields}
    raise Uncacheable(f"the graph's record holds a {kind.__qualname__}, which has no plain form")


def _decode(data: Any) -> Any:
    """The value :func:`_encode` gave ``data`` for; raises (ValueError, KeyError) on anything
    else: only plain values and the records and enums named above are ever built."""
    if data is None or type(data) in (bool, int, str):
        return data
    if type(data) is list:
        return tuple(_decode(v) for v in data)
    if type(data) is dict and data.keys() == {"float"}:
        return float(data["float"])
    if type(data) is dict and data.keys() == {"frozenset"}:
        return frozenset(_decode(v) for v in data["frozenset"])
    if type(data) is dict and data.keys() == {"enum", "name"}:
        return _ENUMS[data["enum"]][data["name"]]
    if type(data) is dict and data.keys() == {"record", "fields"}:
        cls = _RECORDS[data["record"]]
        fields = data["fields"]
        if type(fields) is not dict or set(fields) != {f.name for f in attrs.fields(cls)}:
            raise ValueError(f"a {data['record']} with fields {sorted(fields)}")
        return cls(**{k: _decode(v) for k, v in fields.items()})
    raise ValueError(f"unexpected {type(data).__name__} in the record")


def _record(info: PostExportProcessedModelInfo) -> dict[str, Any]:
    """``info``'s fields as plain data, but the model bytes and the call's structures."""
    return {name: _encode(getattr(info, name)) for name in sorted(_RECORD_FIELDS)}


def _schema_text(name: str, schema: ModelSchema) -> str:
    text = f"{schema.treespec!r} {schema.leaves!r}"
    if " at 0x" in text:
        raise Uncacheable(f"the {name} holds a node without a stable description")
    return text


def key_text(
    traced: PostExportProcessedModelInfo,
    key: ExportKey,
    padding: Mapping[str, int],
    dynamic_scalars: frozenset[str],
) -> str:
    """What the ``for_export`` passes read, as text (the digest's input): the traced graph and
    its record, the passes' own inputs, options and versions. Raises :class:`Uncacheable`
    when part of it has no stable text."""
    lines = [
        FORMAT.decode().strip(),
        f"versions: {_versions()}",
        f"mode: {'training' if key.training else 'eval'}",
        f"export options: {key.options!r}",
        f"call: {_schema_text('call', traced.input_schema)}",
        f"output: {_schema_text('output', traced.output_schema)}",
        f"record: {json.dumps(_record(traced), sort_keys=True)}",
        f"graph: {hashlib.sha256(traced.model).hexdigest()} ({len(traced.model)} bytes)",
        f"embedding padding: {sorted(padding.items())!r}",
        f"dynamic scalars: {sorted(dynamic_scalars)!r}",
    ]
    return "\n".join(lines)


def slot(
    directory: str,
    name: str,
    traced: PostExportProcessedModelInfo,
    key: ExportKey,
    padding: Mapping[str, int],
    dynamic_scalars: frozenset[str],
) -> Slot:
    """Where the processed form of the ``traced`` graph lives under ``directory`` (``name``:
    the module's class, for people reading the directory)."""
    text = key_text(traced, key, padding, dynamic_scalars)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    mode = "train" if key.training else "eval"
    return Slot(Path(directory) / f"{name}-{mode}-{digest}.ortfx", digest)


# ---- ORT's gradient graphs ---------------------------------------------------------------------


@attrs.frozen
class Gradient:
    """ORT's gradient graph of one forward graph (after ``for_gradient``) and what ORT's
    builder said about it: the plain data a training session is opened with."""

    model: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    user_input_names: tuple[str, ...]
    initializer_names: tuple[str, ...]
    forward_outputs: int  # the forward's user outputs and the values kept for backward
    non_differentiable: tuple[int, ...]
    full_shape: tuple[int, ...]
    saved_outputs: tuple[int, ...]
    # Inputs that require grad but reach no output: left out of the build.
    unreachable: tuple[str, ...] = ()
    # Guard outputs ORT folded to constants (static sizes): ortfx puts them back.
    folded: tuple[str, ...] = ()
    # Why the build went without ORT's compute optimizer, when it failed with it.
    compute_optimizer_failure: str | None = None


def gradient_slot(directory: str, forward: bytes, settings: Mapping[str, object]) -> Slot:
    """Where ORT's gradient graph of the ``forward`` graph (a training session's, after the
    ``for_session`` passes) lives, built with ``settings`` (the builder's configuration, the
    options and process facts ``for_gradient`` reads)."""
    lines = [
        FORMAT.decode().strip(),
        f"versions: {_versions()}",
        "kind: gradient",
        f"forward graph: {hashlib.sha256(forward).hexdigest()} ({len(forward)} bytes)",
        *(f"{name}: {value!r}" for name, value in sorted(settings.items())),
    ]
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]
    return Slot(Path(directory) / f"gradient-{digest}.ortfx", digest)


def cached_gradient(
    directory: str,
    forward: bytes,
    settings: Mapping[str, object],
    build: Callable[[], Gradient],
    log: WrapperLog,
    *,
    refused: str = "",
    off: bool = False,
) -> Gradient:
    """ORT's gradient graph of ``forward``: from ``directory`` when it holds it, else built
    and stored. Not cached with no ``directory``, when ``off``, or when ``refused`` (logged)."""
    if not directory or off:
        return build()
    if refused:
        log.log(logging.INFO, GRADIENT_SKIPPED, refused)
        return build()
    if not trusted(directory, log):
        events.emit("gradient_cache", "untrusted", directory)
        return build()
    entry = gradient_slot(directory, forward, settings)
    found = load_gradient(entry, log)
    if found is not None:
        log.log(logging.INFO, GRADIENT_HIT, entry.path)
        events.emit("gradient_cache", "hit", entry.path)
        return found
    log.log(logging.INFO, GRADIENT_MISS, entry.path)
    events.emit("gradient_cache", "miss", entry.path)
    gradient = build()
    store_gradient(entry, gradient, log)
    return gradient


def _gradient_record(gradient: Gradient) -> dict[str, Any]:
    return {
        f.name: list(value) if type(value := getattr(gradient, f.name)) is tuple else value
        for f in attrs.fields(Gradient)
        if f.name != "model"
    }


def _gradient_from(record: dict[str, Any], model: bytes) -> Gradient:
    """The gradient an entry's record describes; raises ValueError unless every field has
    its plain type."""
    fields = {f.name: f for f in attrs.fields(Gradient) if f.name != "model"}
    if record.keys() != fields.keys():
        raise ValueError("a record with other fields")
    values: dict[str, Any] = {}
    for name, value in record.items():
        if name == "forward_outputs":
            ok = type(value) is int
        elif name == "compute_optimizer_failure":
            ok = value is None or type(value) is str
        else:
            kind = (
                str
                if name in ("user_input_names", "initializer_names", "unreachable", "folded")
                else int
            )
            ok = type(value) is list and all(type(v) is kind for v in value)
            value = tuple(value) if ok else value
        if not ok:
            raise ValueError(f"{name} is not plain data of its kind")
        values[name] = value
    return Gradient(model=model, **values)


def load_gradient(entry: Slot, log: WrapperLog) -> Gradient | None:
    """The gradient ``entry`` holds; None when there is none, or it cannot be trusted or read
    (with a WARNING)."""
    found = _read(entry, log)
    if found is None:
        return None
    try:
        return _gradient_from(*found)
    except Exception as e:
        log.log(logging.WARNING, CACHE_CORRUPT, entry.path, str(e) or type(e).__name__)
        return None


def store_gradient(entry: Slot, gradient: Gradient, log: WrapperLog) -> None:
    _write(entry, _gradient_record(gradient), gradient.model, log)


# ---- reading and writing -----------------------------------------------------------------------


def _pack(digest: str, record: dict[str, Any], model: bytes) -> bytes:
    header = json.dumps({"digest": digest, "record": record}, sort_keys=True).encode()
    body = header + b"\n" + model
    return FORMAT + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def _unpack(data: bytes, digest: str) -> tuple[dict[str, Any], bytes]:
    """An entry's record and model bytes; raises ValueError (or any decoding error) when it
    is not a whole entry for ``digest``."""
    if not data.startswith(FORMAT):
        raise ValueError("not an ortfx cache file of this format")
    checksum, body = data[len(FORMAT) :].split(b"\n", 1)
    if hashlib.sha256(body).hexdigest().encode() != checksum:
        raise ValueError("checksum mismatch")
    header, model = body.split(b"\n", 1)
    parsed = json.loads(header)
    if type(parsed) is not dict or parsed.keys() != {"digest", "record"}:
        raise ValueError("not an entry record")
    if parsed["digest"] != digest:
        raise ValueError(f"an entry for another graph ({parsed['digest']})")
    if type(parsed["record"]) is not dict:
        raise ValueError("not an entry record")
    return parsed["record"], model


def _processed_from(
    record: dict[str, Any], model: bytes, traced: PostExportProcessedModelInfo
) -> PostExportProcessedModelInfo:
    """The processed graph an entry's record describes, on top of ``traced``."""
    if record.keys() != _RECORD_FIELDS:
        raise ValueError("a record with other fields")
    info = attrs.evolve(traced, model=model, **{k: _decode(v) for k, v in record.items()})
    graph = onnx.load_model_from_string(model).graph
    names = ([v.name for v in graph.input], [v.name for v in graph.output])
    if names != ([i.name for i in info.inputs], list(info.output_names)):
        raise ValueError("its graph's inputs or outputs differ from its record")
    return info


def _read(entry: Slot, log: WrapperLog) -> tuple[dict[str, Any], bytes] | None:
    """The record and model bytes ``entry`` holds; None when there is none, or it cannot be
    trusted or read (with a WARNING)."""
    try:
        with open(entry.path, "rb") as f:
            problem = refusal(os.fstat(f.fileno()), os.geteuid())
            data = b"" if problem else f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.log(logging.WARNING, CACHE_CORRUPT, entry.path, e.strerror or type(e).__name__)
        return None
    if problem:
        log.log(logging.WARNING, CACHE_CORRUPT, entry.path, f"the file {problem}")
        return None
    try:
        return _unpack(data, entry.digest)
    except Exception as e:  # any damage at all: build again instead of failing the call
        log.log(logging.WARNING, CACHE_CORRUPT, entry.path, str(e) or type(e).__name__)
        return None


def load(
    entry: Slot, traced: PostExportProcessedModelInfo, log: WrapperLog
) -> PostExportProcessedModelInfo | None:
    """The processed form of ``traced`` that ``entry`` holds; None when there is none, or it
    cannot be trusted or read (with a WARNING)."""
    found = _read(entry, log)
    if found is None:
        return None
    try:
        return _processed_from(*found, traced)
    except Exception as e:
        log.log(logging.WARNING, CACHE_CORRUPT, entry.path, str(e) or type(e).__name__)
        return None


def store(entry: Slot, info: PostExportProcessedModelInfo, log: WrapperLog) -> None:
    """Store the processed graph ``info``. Raises :class:`Uncacheable` when its record has no
    plain form."""
    _write(entry, _record(info), info.model, log)


def _write(entry: Slot, record: dict[str, Any], model: bytes, log: WrapperLog) -> None:
    """Write atomically: a reader sees the old file, no file, or the whole new one."""
    data = _pack(entry.digest, record, model)
    if not trusted(str(entry.path.parent), log, create=True):
        return
    temp = None
    try:
        fd, temp = tempfile.mkstemp(
            dir=entry.path.parent, prefix=f".{entry.path.name}.", suffix=".tmp"
        )
        with os.fdopen(fd, "wb") as f:  # mkstemp's mode: only this user reads or writes
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, entry.path)
    except OSError as e:
        if temp is not None:
            _unlink(temp)
        log.log(logging.WARNING, CACHE_WRITE_FAILED, entry.path, e.strerror or type(e).__name__)
        return
    log.log(logging.INFO, CACHE_STORED, entry.path, len(data) // 1024)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
