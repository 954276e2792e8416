"""The one compiled part: the image kernel (server/transforms/_windows.c). Everything else is
declared in pyproject.toml. The extension is optional: without a C compiler the install goes
on and the image built-ins run their numpy kernels (the same bytes, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardserve.server.transforms._windows",
            ["server/transforms/_windows.c"],
            optional=True,
            extra_compile_args=["-O3"],
        )
    ]
)
