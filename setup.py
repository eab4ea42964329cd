"""The C extension of the shared-memory rings; all other metadata is in pyproject.toml.

setuptools builds it on `pip install` (a C compiler and the Python headers are needed:
gcc and python3-dev on Debian). See flowengine/shm/_ring.c.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "flowengine.shm._ring",
            sources=["flowengine/shm/_ring.c"],
            extra_compile_args=[
                "-O2",
                "-std=c11",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
            ],
        )
    ]
)
