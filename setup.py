"""The C extensions (the shared-memory rings; the CPU kernels of quantized linear layers
and decode attention) and the `flowengine.kernels` package; all other metadata is in
pyproject.toml.

setuptools builds the extensions on `pip install` (a C compiler and the Python headers
are needed: gcc and python3-dev on Debian). See flowengine/shm/_ring.c and
flowengine/_cpu_ops.c.
"""

from setuptools import Extension, setup
from setuptools.dist import Distribution

# The Triton kernels live in the top-level kernels/ folder and install as
# flowengine.kernels (pyproject.toml's package-dir). `[tool.setuptools.packages.find]`
# only finds packages by their folder, so this one is added to what it found.
_REMAPPED_PACKAGES = ["flowengine.kernels"]


class _Distribution(Distribution):
    def parse_config_files(self, *args, **kwargs):
        super().parse_config_files(*args, **kwargs)
        self.packages = list(self.packages or [])
        self.packages += [p for p in _REMAPPED_PACKAGES if p not in self.packages]


setup(
    distclass=_Distribution,
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
        ),
        # OpenMP: the kernels share torch's libgomp thread pool (see _cpu_ops.c). The
        # AVX-512 bodies are chosen at run time, so no -march flag: the build runs on
        # any x86-64 (or other) CPU.
        Extension(
            "flowengine._cpu_ops",
            sources=["flowengine/_cpu_ops.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-fopenmp", "-Wall", "-Wextra",
                                "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
            extra_link_args=["-fopenmp"],
        ),
    ]
)
