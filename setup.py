"""The compiled parts: two small kernels of the transforms (server/transforms/*.c, see
server/transforms/compiled.py). Everything else is declared in pyproject.toml. The extensions
are optional: without a C compiler the install goes on and numpy runs instead (the same
bytes, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"shardserve.server.transforms.{name}",
            [f"server/transforms/{name}.c"],
            optional=True,
            extra_compile_args=["-O3"],
        )
        # One-pass crop, flip and normalize of uint8 images; Philox blocks of a batch's draws.
        for name in ("_windows", "_philox")
    ]
)
