"""Builds ortfx._bridge, the runners ONNX Runtime calls for PythonOp nodes (Python.h only, abi3).

Everything else about the package is in pyproject.toml. The extension is optional: if it cannot
be compiled, ortfx installs without it and a model with a custom autograd.Function gets a clear
error instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ortfx._bridge",
            ["ortfx/_bridge.cpp"],
            py_limited_api=True,
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            extra_compile_args=["-std=c++17", "-O2"],
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
