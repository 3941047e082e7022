"""Extras (ac2_jax.extras): importing a module whose optional dependency is missing
raises MissingExtraError, one line naming the extra; an installed one is returned."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from ac2_jax.extras import MissingExtraError, require

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _import_without(blocked: list[str], module: str) -> dict:
    """Imports `module` in a fresh interpreter where `blocked` cannot be imported
    (None in sys.modules); the exception it raised, if any."""
    probe = (
        "import json, sys, traceback\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "try:\n"
        f"    import {module}\n"
        "    print(json.dumps(None))\n"
        "except BaseException as e:\n"
        "    print(json.dumps({'type': type(e).__name__, 'message': str(e),\n"
        "                      'extra': getattr(e, 'extra', None),\n"
        "                      'mro': [c.__name__ for c in type(e).__mro__],\n"
        "                      'last_line': traceback.format_exc().strip().splitlines()[-1]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("blocked, module, message", [
    (["fastapi"], "ac2_jax.serving.app",
     "ac2_jax.serving needs fastapi, which is not installed: pip install 'ac2_jax[serve]'"),
    (["uvicorn"], "ac2_jax.serving",
     "ac2_jax.serving needs uvicorn, which is not installed: pip install 'ac2_jax[serve]'"),
    (["matplotlib"], "ac2_jax.viz.curves",
     "ac2_jax.viz.curves needs matplotlib, which is not installed: "
     "pip install 'ac2_jax[viz]'"),
])
def test_a_missing_extra_is_one_line_naming_it(blocked, module, message):
    err = _import_without(blocked, module)
    assert err is not None, f"{module} imported without {blocked}"
    assert err["type"] == "MissingExtraError" and "ImportError" in err["mro"]
    assert err["message"] == message and "\n" not in err["message"]
    assert err["last_line"] == f"ac2_jax.extras.MissingExtraError: {message}"


def test_the_distillation_report_names_the_viz_extra():
    err = _import_without(["matplotlib"], "ac2_jax.viz.distill_report")
    assert err["type"] == "MissingExtraError" and err["extra"] == "viz"
    assert "pip install 'ac2_jax[viz]'" in err["message"]


def test_trace_pages_need_no_extra():
    assert _import_without(["matplotlib", "fastapi", "uvicorn"], "ac2_jax.viz") is None


def test_require_returns_an_installed_module():
    import json as json_module

    assert require("json", "serve", what="x") is json_module
    decoder = require("json.decoder", "serve", what="x")
    assert decoder is sys.modules["json.decoder"]


def test_require_of_a_missing_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "ac2_jax_no_such_extra", None)
    with pytest.raises(MissingExtraError) as info:
        require("ac2_jax_no_such_extra.sub", "wandb", what="MetricsLogger(wandb=...)")
    assert str(info.value) == ("MetricsLogger(wandb=...) needs ac2_jax_no_such_extra, which "
                               "is not installed: pip install 'ac2_jax[wandb]'")
    assert info.value.extra == "wandb" and info.value.name == "ac2_jax_no_such_extra.sub"
    assert isinstance(info.value, ImportError) and info.value.__cause__ is None


def test_an_installed_module_that_fails_to_import_says_so(tmp_path, monkeypatch):
    """A dependency of the extra's module is missing: not reported as 'not installed'."""
    (tmp_path / "ac2_jax_broken_extra.py").write_text("import ac2_jax_missing_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingExtraError) as info:
        require("ac2_jax_broken_extra", "viz", what="thing")
    message = str(info.value)
    assert "\n" not in message and "not installed" not in message
    assert message.startswith("thing needs ac2_jax_broken_extra, which failed to import (")
    assert "ac2_jax_missing_dep" in message and message.endswith("pip install 'ac2_jax[viz]'")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
