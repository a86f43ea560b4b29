"""kvflow: a KV-cache transfer runtime for LLM serving engines.

The package is layered: ``kvflow.core`` is sans-IO, ``kvflow.runtime`` owns the event loop and
``kvflow.backends`` is the only code that touches a device. Importing kvflow never configures
logging and never touches a GPU.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvflow")
except PackageNotFoundError:  # running from a source tree with PYTHONPATH=src
    __version__ = "0.1.0+src"

__all__ = ["__version__"]
