"""ortfx against other torch versions: TorchScript gone, checkpoint internals moved, opsets."""

from __future__ import annotations

import subprocess
import sys

import torch

# Simulate a torch that no longer ships TorchScript: after `import torch`, its tracer module is
# gone and cannot be imported again (torch.onnx then cannot import its TorchScript exporter either).
_WITHOUT_TORCHSCRIPT = """
import sys
import torch
import torch.jit
sys.modules["torch.jit._trace"] = None
del torch.jit._trace
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCHSCRIPT + code],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_import_survives_a_torch_without_torchscript_and_auto_picks_dynamo() -> None:
    result = _run(
        "import ortfx\n"
        "from ortfx.export import resolve_exporter\n"
        "print(resolve_exporter('auto'), resolve_exporter('torchscript'))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["dynamo", "torchscript"]


def test_requesting_torchscript_without_it_is_a_clear_export_error() -> None:
    result = _run(
        "import torch, ortfx\n"
        "from ortfx.export import export\n"
        "from ortfx.options import ExportOptions\n"
        "from ortfx.schema import ModelSchema\n"
        "from ortfx import io\n"
        "x = torch.randn(2, 3)\n"
        "leaves, spec = io.flatten(io.call_tree((x,), {}))\n"
        "try:\n"
        "    export(torch.nn.Linear(3, 2), leaves, ModelSchema.from_flat(leaves, spec),\n"
        "           ExportOptions('torchscript', 17))\n"
        "except ortfx.OrtfxExportError as e:\n"
        "    print(e)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "Options(exporter='torchscript') was requested, but this torch "
        f"({torch.__version__}) no longer ships the TorchScript ONNX exporter (torch.jit tracing "
        "and torch.onnx.export(..., dynamo=False)). Use Options(exporter='dynamo'), or 'auto', "
        "which picks dynamo on this torch."
    )
