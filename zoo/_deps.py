"""Optional packages: one error for a missing one, which the CLI and the train scripts print as one line."""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingPackage", "require"]


class MissingPackage(RuntimeError):
    """A feature needs an optional package that is not installed; the message names it and the install command.

    A RuntimeError (what these errors were before), so `except RuntimeError` in callers keeps working."""


def require(module: str, purpose: str, install: str, *, package: str | None = None) -> ModuleType:
    """Import `module` or raise MissingPackage("<purpose> needs the <package> package: <install>")."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackage(f"{purpose} needs the {package or module} package: {install}") from None
