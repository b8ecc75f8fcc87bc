"""How many gathered ZeRO-3 parameter elements a rank holds at once, measured two ways.

* ``counted``: DeepSpeed's own view, the elements of parameters whose status is AVAILABLE.
* ``stored``: the elements of the gathered storages still alive, held by anyone (DeepSpeed, ORT,
  autograd). Counting alone could lie: a weight DeepSpeed released may live on in ORT.

Both are sampled right after every gather (the moments a peak can start): DeepSpeed's
coordinator for eager ZeRO-3, ``param.all_gather`` for ortfx. ``stored`` is sampled after
``settle`` seconds: gloo's worker thread drops the tensors of a finished collective a moment
after ``wait()`` returns, so a gather that follows another at once (phase 2's backward gathers
do) briefly sees the previous gather's buffer too. ``stored_at_once`` is the same without the
pause (a transient of the CPU backend, measured, not hidden). Test and benchmark code only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class GatherProbe:
    def __init__(self, params: Iterable[torch.nn.Parameter], settle: float = 0.002) -> None:
        self.params = list(params)
        self.settle = settle
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.counted = 0
        self.stored = 0
        self.stored_at_once = 0
        self._undo: list[Callable[[], None]] = []

    def _live(self) -> int:
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
        return sum(n for _, n in self.storages.values())

    def sample(self) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        for p in self.params:
            if p.data.numel():
                storage = p.data.untyped_storage()
                key = storage.data_ptr()
                if key not in self.storages or self.storages[key][0].expired():
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes() // 4)
        self.stored_at_once = max(self.stored_at_once, self._live())
        time.sleep(self.settle)
        self.stored = max(self.stored, self._live())
        counted = sum(
            p.ds_numel  # type: ignore[attr-defined]
            for p in self.params
            if p.ds_status is ZeroParamStatus.AVAILABLE  # type: ignore[attr-defined]
        )
        self.counted = max(self.counted, counted)

    def reset(self) -> None:
        self.counted = self.stored = self.stored_at_once = 0

    def install(self) -> GatherProbe:
        from deepspeed.runtime.zero.partitioned_param_coordinator import (
            PartitionedParameterCoordinator as Coordinator,
        )

        original = Coordinator.fetch_sub_module

        def fetch_sub_module(coordinator: Any, *args: Any, **kwargs: Any) -> None:
            original(coordinator, *args, **kwargs)
            self.sample()

        Coordinator.fetch_sub_module = fetch_sub_module  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(Coordinator, "fetch_sub_module", original))
        for p in self.params:
            gather = p.all_gather  # type: ignore[attr-defined]

            def all_gather(*args: Any, _gather: Any = gather, **kwargs: Any) -> Any:
                result = _gather(*args, **kwargs)
                self.sample()
                return result

            p.all_gather = all_gather  # type: ignore[attr-defined]
            self._undo.append(lambda p=p, g=gather: setattr(p, "all_gather", g))
        return self

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []
