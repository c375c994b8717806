"""The one-line error for a missing optional library."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, user: str) -> ModuleType:
    """Imports ``module`` for ``user`` (what needs it, for the message), or
    raises ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{user} needs {module!r}, which is not installed: pip install \"fusetrain[{extra}]\" ({e})"
        ) from None
