"""Write a ``.pth`` line into this interpreter's site-packages that installs
``tests/vision_libraries.py``'s import hook at every start (run by ``make``, for the test venv
only): test subprocesses that import transformers or Lightning then import torchvision too.
The line does nothing if this checkout moves away."""

from __future__ import annotations

import site
from pathlib import Path

HOOK = Path(__file__).resolve().parent / "vision_libraries.py"
LINE = (
    "import importlib.util as u, os; p = {path!r}; "
    's = u.spec_from_file_location("ortfx_tests_vision", p) if os.path.exists(p) else None; '
    "m = s and u.module_from_spec(s); s and (s.loader.exec_module(m), m.install_hook())\n"
)

if __name__ == "__main__":
    target = Path(site.getsitepackages()[0]) / "ortfx_tests_torchvision.pth"
    target.write_text(LINE.format(path=str(HOOK)))
    print(f"wrote {target}")
