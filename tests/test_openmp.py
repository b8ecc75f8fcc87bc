"""torch's idle OpenMP threads are released while ORT runs (ortfx.runtime.openmp).

Observed from outside: the process's thread count. torch's OpenMP worker exists after a parallel
torch op; ortfx's forward releases it before ORT runs, and a torch kernel ORT calls inside its
backward (ReLU's gradient) wakes it and has it released again. Run in subprocesses, with two
threads and no OMP_WAIT_POLICY, as the runtime reads both once when it loads. The threads are
counted in /proc: the suite runs on Linux (CI, the tested ORT training wheel, the DeepSpeed
tests); elsewhere these tests fail rather than pass unchecked.
"""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import copy, os, sys, time, torch, ortfx
from torch import nn

release = sys.argv[1] == "1"
assert torch.get_num_threads() == 2

def threads(expected=None):
    # A released worker leaves /proc a moment after the release returns.
    deadline = time.monotonic() + 2.0
    while True:
        n = len(os.listdir("/proc/self/task"))
        if expected is None or n == expected or time.monotonic() > deadline:
            return n
        time.sleep(0.01)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1))
eager = copy.deepcopy(model)
options = ortfx.Options(
    release_torch_threads=release, fallback_policy=ortfx.FallbackPolicy.DISABLE
)
wrapped = ortfx.ORTModule(model, options=options)
x = torch.randn(64, 64)
wrapped(x).sum().backward()  # the session and ORT's own pool threads exist from here on
model.zero_grad(set_to_none=True)

big = torch.ones(1 << 21)
big.mul_(1.0)  # a parallel torch op: its OpenMP worker now exists
before = threads()
loss = wrapped(x).sum()
after_forward = threads(before - 1 if release else None)
loss.backward()  # ReLU's gradient runs torch's threshold_backward inside ORT's backward
time.sleep(0.2)
after_backward = threads()

expected = eager(x).sum()
expected.backward()
assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-5), (loss, expected)
for p, q in zip(model.parameters(), eager.parameters()):
    assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5)
print("threads", before, after_forward, after_backward)
"""


def _run(release: bool, **env: str) -> list[int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    environ.update(OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", **env)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, "1" if release else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=environ,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("threads "), result.stdout
    return [int(n) for n in line.split()[1:]]


def test_torchs_idle_openmp_worker_is_released_before_and_inside_ort_runs() -> None:
    before, after_forward, after_backward = _run(True)
    assert after_forward == before - 1  # released before ORT's forward
    # Woken by the torch kernel inside ORT's backward, and released again after it.
    assert after_backward == after_forward


def test_release_off_or_passive_policy_leaves_torchs_threads_alone() -> None:
    before, after_forward, after_backward = _run(False)
    assert after_forward == before and after_backward == before
    # PASSIVE: the workers sleep on their own; releasing them would be pure cost.
    before, after_forward, after_backward = _run(True, OMP_WAIT_POLICY="passive")
    assert after_forward == before and after_backward == before
