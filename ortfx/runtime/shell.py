"""The engine the ``nn.Module`` façade drives: functions ``(shell, module, args, kwargs) ->
(result, new shell)`` over one frozen :class:`Shell`.

A reader finds each part of a call by its file:

- :mod:`~ortfx.runtime.records`: the frozen records (``Shell``, ``Compiled``, ``FastPath``,
  ``Retry``, ``CallFailed``), ``invalidate`` and ``rebase`` (the façade's compare-and-swap);
- :mod:`~ortfx.runtime.guards`: the one table of torch's global state a call depends on, which
  the fast path's signature, the export key's context and the fallback key all read;
- :mod:`~ortfx.runtime.call`: one call, the fallback gate, the bounded loop of attempts, the
  fast path and the slow path (key, decide);
- :mod:`~ortfx.runtime.fallback`: when and how a call runs in PyTorch instead;
- :mod:`~ortfx.runtime.realize`: the effectful half of a transition (export, persistent cache);
- :mod:`~ortfx.runtime.execute`: running a decided call's graph in ORT and the checks around it;
- :mod:`~ortfx.runtime.runners`: building ORT training and inference runners (sessions, memory
  plans), and ``memory_report``.

Nothing here mutates a shell: the façade (:mod:`ortfx.runtime.module`) commits the shell a call
returns, or the one a failed call carries in :class:`CallFailed`.
"""

from ortfx.runtime.call import call
from ortfx.runtime.fallback import ALWAYS, fall_back
from ortfx.runtime.records import CallFailed, Compiled, Shell, invalidate, rebase
from ortfx.runtime.runners import memory_report

__all__ = [
    "ALWAYS",
    "CallFailed",
    "Compiled",
    "Shell",
    "call",
    "fall_back",
    "invalidate",
    "memory_report",
    "rebase",
]
