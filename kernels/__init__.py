"""Triton kernels of FlowEngine, imported as ``flowengine.kernels``.

This folder sits at the top of the repository (DESIGN.md §10), so wherever the
repository root is on ``sys.path`` (``python -m pytest`` or ``python -m flowengine`` run
from a checkout) it is also importable as a top-level ``kernels``, the name of an
unrelated PyPI package that transformers (>= 5.25) imports at start-up. Imported under
that name, this module hands the import over to the installed package, found on
``sys.path`` without the repository root (nor another FlowEngine checkout's, which would
hand it back). Where none is installed it stays this empty
module, with no ``__version__``: transformers (5.17) imports the name to read a version
when no distribution metadata exists, and takes "N/A" as "not available".
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _flowengine_checkout(entry: str) -> bool:
        """Whether `entry` holds a FlowEngine kernels/ folder (this one, or another
        checkout's on the same path): handing over to it would come back here."""
        init = os.path.join(os.path.abspath(entry or os.curdir), "kernels", "__init__.py")
        try:
            with open(init, encoding="utf-8") as f:
                return f.read(200).startswith('"""Triton kernels of FlowEngine')
        except OSError:
            return False

    _path = [p for p in sys.path if not _flowengine_checkout(p)]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
