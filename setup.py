"""The one part of the build pyproject.toml cannot declare stably: the router's compiled loops
(``copse.router._native``, plain C against the CPython API, built with the machine's C compiler).
``-ffp-contract=off``: no fused multiply-add, so the arithmetic matches numpy's to the bit."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "copse.router._native",
            sources=["router/copse/router/_native.c"],
            extra_compile_args=["-O2", "-ffp-contract=off"],
            # Without a C compiler the package still installs: copse.router.loops then runs
            # the same loops in Python (slower).
            optional=True,
        )
    ]
)
