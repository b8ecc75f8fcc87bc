"""ortfx against other torch versions: TorchScript gone, checkpoint internals moved, opsets."""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ortfx import io
from ortfx.errors import OrtfxExportError
from ortfx.export import export
from ortfx.options import ExportOptions
from ortfx.schema import ModelSchema

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
    # the last line: importing onnxruntime may print (its ORTModule imports deepspeed if present)
    assert result.stdout.splitlines()[-1].split() == ["dynamo", "torchscript"]


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
    assert result.stdout.splitlines()[-1] == (
        "Options(exporter='torchscript') was requested, but this torch "
        f"({torch.__version__}) no longer ships the TorchScript ONNX exporter (torch.jit tracing "
        "and torch.onnx.export(..., dynamo=False)). Use Options(exporter='dynamo'), or 'auto', "
        "which picks dynamo on this torch."
    )


class ByName(nn.Module):
    """Calls the ``checkpoint`` this file imported by name at import time."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


class ByAttribute(ByName):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return x


class ByPartial(ByName):
    """transformers' style: a functools.partial of checkpoint stored on the module."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(reentrant)
        self.checkpoint_func = functools.partial(checkpoint, use_reentrant=reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.checkpoint_func(block, x)
        return x


def _closure_over_checkpoint() -> Any:
    original = torch.utils.checkpoint.checkpoint
    return lambda block, x: original(block, x, use_reentrant=True)


class ByClosure(ByName):
    """A binding ortfx cannot see: the reentrant variant is still counted (CheckpointFunction)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call = _closure_over_checkpoint()
        for block in self.blocks:
            x = call(block, x)
        return x


def _export(model: nn.Module, x: torch.Tensor) -> int:
    leaves, spec = io.flatten(io.call_tree((x,), {}))
    options = ExportOptions("torchscript", 17)
    return export(model, leaves, ModelSchema.from_flat(leaves, spec), options).checkpoint_calls


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("style", [ByName, ByAttribute, ByPartial])
def test_checkpoint_calls_are_counted_through_public_names_only(
    style: type[ByName], reentrant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count is exact without the private generator torch 2.14 stopped calling, and the
    module's bindings of checkpoint are restored after export."""
    monkeypatch.delattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator")
    model = style(reentrant)
    assert _export(model, torch.randn(2, 4)) == 3
    assert checkpoint is torch.utils.checkpoint.checkpoint
    assert torch.utils.checkpoint.CheckpointFunction.__name__ == "CheckpointFunction"
    if isinstance(model, ByPartial):
        assert model.checkpoint_func.func is checkpoint


def test_reentrant_checkpoint_through_an_unseen_binding_is_counted() -> None:
    assert _export(ByClosure(True), torch.randn(2, 4)) == 3


def test_checkpoint_keywords_follow_torch() -> None:
    """Keywords reach the function only in the non-reentrant variant, as in torch."""

    class Keywords(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.reentrant = reentrant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scaled: torch.Tensor = checkpoint(
                lambda t, *, k: t * k, x, k=2.0, use_reentrant=self.reentrant
            )
            return scaled

    assert _export(Keywords(False), torch.randn(2, 4)) == 1
    # PyTorch itself rejects the keyword in the reentrant variant: its own error, not ortfx's.
    with pytest.raises(ValueError, match="Unexpected keyword arguments: k") as info:
        _export(Keywords(True), torch.randn(2, 4))
    assert not isinstance(info.value, OrtfxExportError)


def test_package_metadata_admits_the_tested_matrix() -> None:
    """pyproject's torch range and requires-python admit what the README says is tested."""
    import pathlib
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    root = pathlib.Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    torch_req = next(
        Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"
    )
    for version in ("2.13.0", "2.14.1", torch.__version__.split("+")[0]):
        assert torch_req.specifier.contains(version), (torch_req, version)
    assert not torch_req.specifier.contains("2.15.0")  # untested: opt in by raising the bound
    python = SpecifierSet(project["requires-python"])
    assert python.contains("3.11.9") and python.contains("3.12.0")
    # the README's matrix states exactly what the metadata admits
    readme = (root / "README.md").read_text()
    assert "## Supported and tested versions" in readme
    assert f'`requires-python = "{project["requires-python"]}"`' in readme
    assert "`>=2.6,<2.15`" in readme and "torch>=2.6,<2.15" in project["dependencies"]
