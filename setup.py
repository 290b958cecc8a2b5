"""The one part of the build pyproject.toml cannot declare stably: the router's compiled loops
(``copse.router._native``, plain C against the CPython API, built with the machine's C compiler).
``-ffp-contract=off``: no fused multiply-add, so the arithmetic matches numpy's to the bit.
The build carries the SHA-256 of the source it was compiled from (``SOURCE_SHA256``), which
copse.router.loops compares with the source next to it: a build older than an edit is not used."""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "router/copse/router/_native.c"
SOURCE_SHA256 = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[
        Extension(
            "copse.router._native",
            sources=[SOURCE],
            extra_compile_args=["-O2", "-ffp-contract=off"],
            define_macros=[("COPSE_NATIVE_SOURCE_SHA256", f'"{SOURCE_SHA256}"')],
            # Without a C compiler the package still installs: copse.router.loops then runs
            # the same loops in Python (slower).
            optional=True,
        )
    ]
)
