"""Scenarios for test_good_citizen.py, each run in a fresh interpreter (``python -m
tests.citizen_worker <scenario>``): what ortfx leaves behind in a process can only be seen from
a process where nothing ran before. Each prints one JSON line."""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _Op(nn.Module):
    def __init__(self, body: Callable[..., Any], *modules: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.parts = nn.ModuleList(modules)

    def forward(self, *args: torch.Tensor) -> Any:
        return self.body(self, *args)


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2.0


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


# One user model per op ortfx writes its own way (every TorchScript symbolic ortfx registers
# for its exports, and the PythonOp of a custom Function): name -> (model, inputs).
torch.manual_seed(0)  # the same weights in every worker process (tests compare their bytes)
USER_MODELS: dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]] = {
    "diff": (_Op(lambda m, x: torch.diff(x, dim=-1)), (_x(2, 5),)),
    "cumsum_bool": (_Op(lambda m, x: torch.cumsum(x > 0, dim=-1)), (_x(2, 5),)),
    "sdpa_gqa": (
        _Op(
            lambda m, q, k: F.scaled_dot_product_attention(q, k, k, enable_gqa=True),
        ),
        (_x(1, 4, 3, 8), _x(1, 2, 3, 8)),
    ),
    "hardtanh": (_Op(lambda m, x: F.hardtanh(x)), (_x(2, 5),)),
    "relu6": (_Op(lambda m, x: F.relu6(x)), (_x(2, 5),)),
    "softshrink": (_Op(lambda m, x: F.softshrink(x)), (_x(2, 5),)),
    "hardshrink": (_Op(lambda m, x: F.hardshrink(x)), (_x(2, 5),)),
    "clamp": (_Op(lambda m, x: torch.clamp(x, min=0.0)), (_x(2, 5),)),
    "clamp_tensor": (_Op(lambda m, x, b: torch.clamp(x, min=b)), (_x(2, 5), _x(5))),
    "clamp_min": (_Op(lambda m, x: torch.clamp_min(x, 0.1)), (_x(2, 5),)),
    "clamp_max": (_Op(lambda m, x: torch.clamp_max(x, 0.1)), (_x(2, 5),)),
    "floor_divide": (_Op(lambda m, x: torch.floor_divide(x, 0.3)), (_x(2, 5),)),
    "div_trunc": (_Op(lambda m, x: torch.div(x, 0.3, rounding_mode="trunc")), (_x(2, 5),)),
    "remainder": (_Op(lambda m, x: torch.remainder(x, 0.3)), (_x(2, 5),)),
    "rshift": (_Op(lambda m, x: (x * 10).long() >> 1), (_x(2, 5),)),
    "atan2": (_Op(lambda m, y, x: torch.atan2(y, x)), (_x(2, 5), _x(2, 5))),
    "embedding": (
        _Op(lambda m, i: m.parts[0](i), nn.Embedding(10, 4, padding_idx=0)),
        (torch.tensor([[1, 2, 0]]),),
    ),
    "cdist": (_Op(lambda m, a, b: torch.cdist(a, b)), (_x(1, 3, 4), _x(1, 2, 4))),
    "flip": (_Op(lambda m, x: torch.flip(x, (1,))), (_x(2, 5),)),
    "group_norm": (_Op(lambda m, x: m.parts[0](x), nn.GroupNorm(2, 4)), (_x(2, 4, 3),)),
    "instance_norm": (_Op(lambda m, x: m.parts[0](x), nn.InstanceNorm1d(4)), (_x(2, 4, 3),)),
    "histc": (_Op(lambda m, x: torch.histc(x, bins=4)), (_x(2, 5),)),
    "index_add": (
        _Op(lambda m, x, s: x.index_add(0, torch.tensor([0, 0]), s)),
        (_x(3, 4), _x(2, 4)),
    ),
    "detach": (_Op(lambda m, x: m.parts[0](x).detach() * 2, nn.Linear(5, 5)), (_x(2, 5),)),
    "cross_entropy": (
        _Op(lambda m, x, y: F.cross_entropy(x, y)),
        (_x(3, 5), torch.tensor([0, 4, 2])),
    ),
    "gather": (_Op(lambda m, x, i: torch.gather(x, 1, i)), (_x(2, 5), torch.tensor([[0], [4]]))),
    "scatter_reduce": (
        _Op(lambda m, x, s: x.scatter_reduce(1, torch.tensor([[0, 0]]), s, "sum")),
        (_x(1, 5), _x(1, 2)),
    ),
    "one_hot": (_Op(lambda m, i: F.one_hot(i, 5)), (torch.tensor([0, 4, 2]),)),
    "custom_function": (_Op(lambda m, x: Scale.apply(m.parts[0](x)), nn.Linear(5, 5)), (_x(2, 5),)),
}


def _user_export(name: str) -> tuple[str, str]:
    """What the user's own ``torch.onnx.export`` gives: ("ok", hex of the bytes) or ("error",
    the exception)."""
    model, inputs = USER_MODELS[name]
    buffer = io.BytesIO()
    try:
        torch.onnx.export(model.eval(), inputs, buffer, dynamo=False, opset_version=17)
    except Exception as e:
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "ok", buffer.getvalue().hex()


def _registry() -> dict[str, list[str]]:
    """Every TorchScript symbolic registration, by name: (opset, function, custom?)."""
    from ortfx import _torch

    tables = _torch._symbolic_registry()._registry
    snapshot = {}
    for name, group in tables.items():
        functions = group._functions
        snapshot[name] = sorted(
            f"{opset}:{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', repr(f))}:"
            f"{functions.overridden(opset)}"
            for opset, f in functions._merged.items()
        )
    return snapshot


def _train_with_ortfx() -> None:
    """ortfx exports and trains modules that use its symbolics, with both exporters."""
    import ortfx

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4, padding_idx=0)
            self.fc = nn.Linear(4, 4)

        def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = Scale.apply(self.fc(self.emb(ids)))
            return (F.relu6(h).sum() + torch.atan2(y, y + 1).sum()) * 1.0

    for exporter in ("torchscript", "dynamo"):
        model = ortfx.ORTModule(
            Model(),
            options=ortfx.Options(exporter=exporter, fallback_policy=ortfx.FallbackPolicy.DISABLE),
        )
        model(torch.tensor([[1, 2, 0]]), torch.randn(3)).backward()


def user_export() -> None:
    before = {name: _user_export(name) for name in USER_MODELS}
    registry_before = _registry()
    _train_with_ortfx()
    after = {name: _user_export(name) for name in USER_MODELS}
    registry_after = _registry()
    loads = {}
    import onnx
    import onnxruntime

    for name, (kind, data) in after.items():
        if kind != "ok":
            continue
        proto = onnx.load_model_from_string(bytes.fromhex(data))
        domains = sorted({n.domain for n in proto.graph.node} - {""})
        try:
            onnxruntime.InferenceSession(bytes.fromhex(data), providers=["CPUExecutionProvider"])
            loads[name] = ("loads", domains)
        except Exception as e:
            loads[name] = (f"refused: {str(e)[:200]}", domains)
    print(
        json.dumps(
            {
                "differ": sorted(n for n in USER_MODELS if before[n] != after[n]),
                "registry_same": registry_before == registry_after,
                "registry_diff": sorted(
                    k
                    for k in set(registry_before) | set(registry_after)
                    if registry_before.get(k) != registry_after.get(k)
                ),
                "exported": sorted(n for n, (k, _) in after.items() if k == "ok"),
                "loads": loads,
            }
        )
    )


def _fresh(train_first: bool) -> None:
    """A fresh process (torch's symbolic registry not yet filled, as torch fills it on its
    first export): optionally ortfx trains first, then the user exports every model."""
    if train_first:
        _train_with_ortfx()
    exported = {name: _user_export(name) for name in USER_MODELS}
    print(json.dumps({"exported": exported, "registry": _registry()}))


# ---- the process around an export: what another thread sees -----------------------------------


def _process_view() -> dict[str, Any]:
    """The identities another thread's code would see, by name."""
    import torch.utils.checkpoint

    view: dict[str, Any] = {
        name: id(next(vars(k)[name] for k in torch.Tensor.__mro__ if name in vars(k)))
        for name in ("requires_grad", "grad_fn", "is_leaf", "requires_grad_", "register_hook")
    }
    view["is_grad_enabled"] = id(torch.is_grad_enabled)
    view["_set_grad_enabled"] = id(torch._C._set_grad_enabled)
    view["Module.__setattr__"] = id(torch.nn.Module.__setattr__)
    view["RemovableHandle.remove"] = id(torch.utils.hooks.RemovableHandle.remove)
    view["F.linear"] = id(torch.nn.functional.linear)
    view["sys.stdout"] = id(sys.stdout)
    view["sys.stderr"] = id(sys.stderr)
    import os

    view["fd1"] = tuple(os.fstat(1)[1:3])
    view["fd2"] = tuple(os.fstat(2)[1:3])
    view["grad mode"] = torch.is_grad_enabled()
    return view


def during_export() -> None:
    """One thread exports a module whose forward waits until another thread has looked at the
    process (and trained a plain model); the other thread's view must be torch's own."""
    import ortfx

    inside = threading.Event()
    looked = threading.Event()

    class Waits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            if not inside.is_set():
                inside.set()
                looked.wait(60)
            return h * (2.0 if x.requires_grad else 3.0)

    before = _process_view()
    seen: dict[str, Any] = {}

    def other() -> None:
        inside.wait(60)
        try:
            with torch.no_grad():  # grad mode is per thread: this one's is off
                seen["view"] = _process_view()
            # A plain model trained here reads autograd attributes and registers hooks.
            torch.manual_seed(1)
            plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
            x = torch.randn(8, 4)
            out = plain(x)
            hooked: list[bool] = []
            out.register_hook(lambda g: hooked.append(True))
            seen["flags"] = [out.requires_grad, out.grad_fn is not None, x.is_leaf]
            out.sum().backward()
            seen["hooked"] = hooked
            seen["grad"] = float(plain[0].weight.grad.abs().sum())
            seen["view_after"] = _process_view()
        finally:
            looked.set()

    thread = threading.Thread(target=other)
    thread.start()
    strict = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    wrapped = ortfx.ORTModule(Waits(), options=strict)
    x_in = torch.randn(2, 4)
    y = wrapped(x_in)
    thread.join()
    torch.manual_seed(1)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref_x = torch.randn(8, 4)
    reference(ref_x).sum().backward()
    expected_grad = float(reference[0].weight.grad.abs().sum())
    before_off = dict(before, **{"grad mode": False})
    print(
        json.dumps(
            {
                "view_differs": sorted(k for k in before if seen["view"][k] != before_off[k]),
                "after_differs": sorted(k for k in before if seen["view_after"][k] != before[k]),
                "flags": seen["flags"],
                "hooked": seen["hooked"],
                "grad_equal": seen["grad"] == expected_grad,
                "ortfx_matches_eager": bool(torch.allclose(y, wrapped.module(x_in), atol=1e-6)),
                "end_differs": sorted(k for k in before if _process_view()[k] != before[k]),
            }
        )
    )


# ---- exit ----------------------------------------------------------------------------------


def _short_run(delay: float) -> None:
    import ortfx

    for _ in range(2):
        m = ortfx.ORTModule(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
        with torch.no_grad():
            m(torch.randn(4, 8))
        del m  # the arena's shrinker starts 0.2 s after the last session is collected
    time.sleep(delay)


def short_runs() -> None:
    """Fork ``count`` children (two at a time) from this imported interpreter, each creating
    and dropping a wrapper and then exiting normally (full interpreter shutdown) at a moment
    spread over the window in which the arena's shrinker runs; report each exit status."""
    import os

    import ortfx  # noqa: F401  # imported once, in the parent

    count = int(sys.argv[2])
    statuses: list[int] = []
    running: list[int] = []

    def reap() -> None:
        pid, status = os.wait()
        running.remove(pid)
        statuses.append(os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status))

    for k in range(count):
        delay = 0.1 + 0.25 * k / max(count - 1, 1)
        if len(running) == 2:
            reap()
        pid = os.fork()
        if pid == 0:  # the child: a short script's whole life, then a normal exit
            code = 0
            try:
                _short_run(delay)
            except BaseException:
                code = 3
            sys.stdout.flush()
            sys.exit(code)
        running.append(pid)
    while running:
        reap()
    print(json.dumps({"statuses": statuses}))


# ---- two threads' first wrappers -----------------------------------------------------------


def _first_wrappers() -> tuple[list[str], float]:
    """Two threads, released together, each build a wrapper whose first call flattens a new
    dataclass and runs a custom Function, then train one step; errors and the largest
    difference to eager (outputs and gradients)."""
    import copy
    import dataclasses

    import ortfx

    errors: list[str] = []
    diffs: list[float] = []
    barrier = threading.Barrier(2)

    @dataclasses.dataclass
    class Batch:  # one new type for both threads: each would register it first
        x: torch.Tensor
        scale: float

    def one(seed: int) -> None:
        try:

            class Model(nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.lin = nn.Linear(4, 4)

                def forward(self, batch: Batch) -> torch.Tensor:
                    return Scale.apply(self.lin(batch.x)) * batch.scale

            torch.manual_seed(seed)
            eager = Model()
            strict = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
            wrapped = ortfx.ORTModule(copy.deepcopy(eager), options=strict)
            batch = Batch(torch.randn(3, 4), 0.5)
            barrier.wait(30)
            out = wrapped(batch)
            ref = eager(batch)
            out.sum().backward()
            ref.sum().backward()
            diffs.append(float((out - ref).detach().abs().max()))
            grads = zip(wrapped.module.parameters(), eager.parameters(), strict=True)
            diffs.extend(float((a.grad - b.grad).abs().max()) for a, b in grads)
        except BaseException as e:
            errors.append(f"{type(e).__name__}: {e}")
            barrier.abort()

    # Switch threads as often as the interpreter can: a check-then-act without a lock (is the
    # type registered? is the bridge set up?) is then caught between its check and its act.
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=one, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors, max(diffs, default=float("inf"))


def _wait(pid: int, *, seconds: float) -> int | None:
    """The child's wait status, or None (the child killed) if it has not ended in time."""
    import os
    import signal

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def first_wrappers_at_once() -> None:
    """Fork a fresh child per round from this imported interpreter (nothing registered yet
    there), each running :func:`_first_wrappers`."""
    import os

    import ortfx  # noqa: F401  # imported once; the children start with nothing registered

    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    errors: list[str] = []
    worst = 0.0
    for _ in range(rounds):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            code = 0
            try:
                found = _first_wrappers()
                payload = json.dumps(found).encode()
            except BaseException as e:
                payload = json.dumps(([f"child: {type(e).__name__}: {e}"], 0.0)).encode()
                code = 3
            os.write(write, payload)
            os.close(write)
            sys.exit(code)
        os.close(write)
        status = _wait(pid, seconds=60)
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        if status is None:
            errors.append("a child hung for 60 s (a deadlock) and was killed")
            continue
        if not os.WIFEXITED(status) or os.WEXITSTATUS(status) not in (0, 3) or not data:
            errors.append(f"child ended with status {status}")
            continue
        child_errors, diff = json.loads(data)
        errors.extend(child_errors)
        worst = max(worst, diff)
    print(json.dumps({"errors": errors, "rounds": rounds, "max_diff": worst}))


if __name__ == "__main__":
    {
        "user_export": user_export,
        "torch_only": lambda: _fresh(train_first=False),
        "ortfx_first": lambda: _fresh(train_first=True),
        "during_export": during_export,
        "short_runs": short_runs,
        "first_wrappers_at_once": first_wrappers_at_once,
    }[sys.argv[1]]()
