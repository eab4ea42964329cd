"""Triton kernels of FlowEngine, imported as ``flowengine.kernels``.

This folder sits at the top of the repository (DESIGN.md §10), so wherever the
repository root is on ``sys.path`` (``python -m pytest`` or ``python -m flowengine`` run
from a checkout) it is also importable as a top-level ``kernels``, the name of an
unrelated PyPI package that transformers (>= 5.25) imports at start-up. Imported under
that name, this module hands the import over to the installed package, found on
``sys.path`` without the repository root. Where none is installed it stays this empty
module, with no ``__version__``: transformers (5.17) imports the name to read a version
when no distribution metadata exists, and takes "N/A" as "not available".
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
