"""Imports point one way: a layer never imports a higher one (DESIGN.md)."""

import ast
import pathlib

LAYERS = ["trace", "segments", "losses", "models", "sampling", "serving", "envs",
          "orchestration", "training", "evals", "viz"]
RANK = {name: i for i, name in enumerate(LAYERS)}
ROOT = pathlib.Path(__file__).resolve().parents[1] / "ac2_jax"


def _imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno


def test_every_package_is_a_known_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYERS), f"unknown layers: {packages - set(LAYERS)}"


def test_lower_layers_never_import_higher_ones():
    violations = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 2:
            continue  # ac2_jax/__init__.py
        own = rel[0]
        for module, line in _imports(path):
            parts = module.split(".")
            if parts[0] != "ac2_jax" or len(parts) < 2 or parts[1] not in RANK:
                continue
            if RANK[parts[1]] > RANK[own]:
                violations.append(f"{path.relative_to(ROOT.parent)}:{line} ({own}) imports {module}")
            if own == "orchestration" and parts[1] == "serving":
                violations.append(f"{path.relative_to(ROOT.parent)}:{line}: orchestrators reach the "
                                  f"model only through an OpenAI client, not {module}")
    assert not violations, "\n".join(violations)


def test_core_never_imports_torch_or_transformers():
    bad = [f"{p.relative_to(ROOT.parent)}:{line} imports {m}"
           for p in ROOT.rglob("*.py") for m, line in _imports(p)
           if m.split(".")[0] in ("torch", "transformers")]
    assert not bad, "\n".join(bad)
