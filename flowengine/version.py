"""FlowEngine's version: the one source that pyproject.toml (`dynamic = ["version"]`),
`flowengine.__version__`, `flowengine --version` and the `/version` route read.

NOTE: keep this a plain string literal; setuptools reads it without importing the package.
"""

__version__ = "0.1.0"
