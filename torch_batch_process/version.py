"""The library's version: a module of its own, so that every layer may read it (the engine tells it to
``tbp report``) without importing the package's entry points."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
