"""The native part of the data plane (transfer/_native.c), built with gcc by ``pip install``.

Optional: where it cannot be built the install goes on and kvstore runs its pure-Python
fallback (transfer/native.py says which one runs). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(
    ext_modules=[
        Extension(
            "transfer._native",
            ["transfer/_native.c"],
            extra_compile_args=["-O2", "-std=gnu11", *WARNINGS],
            optional=True,
        )
    ]
)
