"""Optional dependencies (setup.py's extras): a missing one is a one-line hint.

`require("fastapi", "serve", what="ac2_jax.serving")` imports and returns
fastapi; without it, it raises `MissingExtraError` (an ImportError) whose
message is one line naming the extra to install:

    ac2_jax.serving needs fastapi, which is not installed: pip install 'ac2_jax[serve]'
"""

from __future__ import annotations

import importlib
import types

DISTRIBUTION = "ac2_jax"


class MissingExtraError(ImportError):
    """An optional dependency is not installed (or failed to import); the message
    is one line with the `pip install 'ac2_jax[<extra>]'` that brings it."""

    def __init__(self, message: str, *, name: str, extra: str):
        super().__init__(message, name=name)
        self.extra = extra


def require(module: str, extra: str, *, what: str) -> types.ModuleType:
    """Imports `module` and returns it. When it is not installed, raises
    MissingExtraError: "<what> needs <module>, which is not installed: pip install
    'ac2_jax[<extra>]'". An installed module whose own import fails is reported the
    same way, with the error, and chained to it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = f"pip install '{DISTRIBUTION}[{extra}]'"
        top = module.split(".")[0]
        missing = isinstance(e, ModuleNotFoundError) and e.name is not None
        if missing and (module == e.name or module.startswith(f"{e.name}.")):
            raise MissingExtraError(
                f"{what} needs {top}, which is not installed: {hint}", name=module, extra=extra
            ) from None
        detail = " ".join(str(e).split()) or type(e).__name__
        raise MissingExtraError(
            f"{what} needs {top}, which failed to import ({detail}): {hint}",
            name=module,
            extra=extra,
        ) from e
