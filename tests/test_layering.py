"""Imports point one way: a layer never imports a higher one (docs/design.md).

No module imports itself through others (no import cycles, function-level
imports included). Also: the light packages import no server, plotting or torch code; the core
packages import only what setup.py's core requirements install; and each package's `__all__`
keeps the public-API contract (docs/design.md, "Public API"):

- `__all__` is curated: what a user of the package needs (the entry points, the types they
  pass and get back, the registries and base classes an extension implements), at most
  `MAX_NAMES` names a namespace and `MAX_TOTAL` over all of them; not every public function
  of every module.
- Every name in `__all__` resolves on the package and is the library's own (a function or
  class defined in ac2_jax, most in the package itself); no third-party re-export.
- The `__init__` says which of its imports are API: a plain `from ac2_jax.<pkg>... import x`
  is in `__all__`; a name kept importable from the package for existing code without being
  API is imported as `x as x` (or resolves through a deprecation alias, which warns).
- A name outside `__all__` is internal even where its module has no underscore: it stays
  importable from its defining module and may change.
- No exported name shadows a submodule of its package (`KNOWN_SHADOWS` lists the ones left).
"""

import ast
import functools
import importlib
import importlib.metadata
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.test_public_api import PACKAGES as PUBLIC

LAYERS = ["trace", "segments", "losses", "text", "models", "sampling", "serving", "envs",
          "orchestration", "training", "evals", "viz", "recipes", "testing"]
RANK = {name: i for i, name in enumerate(LAYERS)}
ROOT = pathlib.Path(__file__).resolve().parents[1] / "ac2_jax"
SETUP = ROOT.parent / "setup.py"
# Packages the core install (setup.py REQUIRES) must be enough for.
CORE = ["trace", "segments", "losses", "text", "models", "sampling", "envs", "orchestration",
        "training", "evals"]
# Distributions that only extras may bring (serve, viz, dev).
HEAVY = {"fastapi", "uvicorn", "starlette", "matplotlib", "torch", "transformers"}
# Modules a core dependency imports only when they happen to be installed (inside a
# try / except), so [dev]'s notebook kernel makes them appear: flax.nnx.reprlib probes
# IPython (and so traitlets) for a notebook display; numpy.f2py probes charset_normalizer;
# jax._src.pickle_util probes cloudpickle (which the textarena extra brings); httpx's and
# urllib3's decoders probe brotli (which the openenv extra brings); `import jax` probes
# libtpu (jax._src.cloud_tpu_init; the tpu-aot extra brings it).
PROBED = {"IPython", "traitlets", "charset_normalizer", "cloudpickle", "brotli", "_brotli",
          "libtpu"}
# The public-API contract (module docstring): names a namespace, entries over all of them.
MAX_NAMES = 25
MAX_TOTAL = 240


@functools.cache
def _import_statements(path: pathlib.Path) -> tuple:
    """(from_module or None for `import`, level, names, line) of each import statement
    at any level of the file; parsed once for the module's several checks."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.append((None, 0, tuple(a.name for a in node.names), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            out.append((node.module or "", node.level, tuple(a.name for a in node.names),
                        node.lineno))
    return tuple(out)


def _imports(path):
    for module, level, names, line in _import_statements(path):
        if module is None:
            for name in names:
                yield name, line
        elif module and level == 0:
            yield module, line


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


def _module_graph(*roots: pathlib.Path) -> dict[str, set[str]]:
    """module -> the modules it imports, of the packages at `roots` (default: ac2_jax),
    at any level of the file; `from pkg import name` is an edge to pkg.name when that is
    a module, else pkg."""
    modules = {}
    for root in roots or (ROOT,):
        for path in root.rglob("*.py"):
            parts = (root.name,) + path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name):
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for module, level, names, _ in _import_statements(path):
            if module is None:
                edges |= {known(name) for name in names}
            else:
                base = module
                if level:
                    up = package.split(".")[:len(package.split(".")) - level + 1]
                    base = ".".join(up + ([module] if module else []))
                for name in names:
                    edges.add(known(f"{base}.{name}") if f"{base}.{name}" in modules
                              else known(base))
        graph[name] = {e for e in edges if e and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = _cycles(_module_graph())
    assert not cycles, "import cycles (move what both need into a lower module): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_no_import_cycles_in_the_lab():
    """benchmarks/ and experiments/ too (a study's modules import down to a shared one)."""
    cycles = _cycles(_module_graph(ROOT.parent / "benchmarks", ROOT.parent / "experiments"))
    assert not cycles, "import cycles (move what both need into a lower module): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_library_imports_no_deprecated_path():
    """ac2_jax imports a moved module or a renamed name by its new path only (the old ones,
    `_deprecation.MOVED_MODULES` and each package's `DEPRECATED`, are for users' code)."""
    from ac2_jax._deprecation import MOVED_MODULES

    bad = []
    for path in ROOT.rglob("*.py"):
        for module, level, names, line in _import_statements(path):
            if level:
                continue
            for name in names if module is None else [module]:
                if name in MOVED_MODULES:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
            if module in PUBLIC_MODULES or module in MODULES_BECOME_PACKAGES:
                old = set(getattr(importlib.import_module(module), "DEPRECATED", {})) & set(names)
                bad += [f"{path.relative_to(ROOT.parent)}:{line} imports {module}.{n}" for n in old]
            for name in names if module else []:
                if f"{module}.{name}" in MOVED_MODULES:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}.{name}")
    assert not bad, "deprecated paths (use the new ones):\n" + "\n".join(bad)


PUBLIC_MODULES = {f"ac2_jax.{p}" for p in PUBLIC}
# A folder that took a moved module's path keeps that module's names as its DEPRECATED.
MODULES_BECOME_PACKAGES = {"ac2_jax.serving.lifecycle"}


def test_core_never_imports_torch_or_transformers():
    bad = [f"{p.relative_to(ROOT.parent)}:{line} imports {m}"
           for p in ROOT.rglob("*.py") for m, line in _imports(p)
           if m.split(".")[0] in ("torch", "transformers")]
    assert not bad, "\n".join(bad)


@functools.cache
def _packages_distributions() -> dict:
    """Top-level module -> distributions, read once (a scan of every installed
    distribution's files: ~0.4 s a call)."""
    return importlib.metadata.packages_distributions()


def _imported(code: str) -> dict:
    """Top-level modules -> distributions, imported by `code` in a fresh interpreter
    (minus what the interpreter imports at startup). The child lists the modules; the
    distributions come from this interpreter's (the same environment's) table."""
    return _imported_stages(code)[0]


@functools.cache
def _imported_stages(*stages: str) -> tuple[dict, ...]:
    """`_imported` after each of `stages`, run one after the other in ONE fresh
    interpreter: stage i's modules are those `stages[0]` .. `stages[i]` imported
    together. Where each stage's code imports all of the previous ones' (e.g. a
    package, then that package and two more), stage i is exactly `_imported` of
    its own code, and the chain costs one interpreter instead of one a stage
    (each imports jax: ~1-2 CPU s). Cached: the tests sharing a chain run it once."""
    probe = ["import importlib.metadata, json, sys", "base = set(sys.modules)"]
    for code in stages:
        probe += [code, "print('stage', json.dumps(sorted({m.split('.')[0] "
                        "for m in set(sys.modules) - base})))"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", "\n".join(probe)], capture_output=True,
                         text=True, env=env, cwd=ROOT.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    pd = _packages_distributions()
    lines = [x.removeprefix("stage ") for x in out.stdout.splitlines() if x.startswith("stage [")]
    assert len(lines) == len(stages), out.stdout[-2000:]
    return tuple({m: pd.get(m, []) for m in json.loads(line)} for line in lines)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _setup_lists() -> tuple[list[str], dict]:
    """REQUIRES and EXTRAS as written in setup.py (literals)."""
    tree = ast.parse(SETUP.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("REQUIRES", "EXTRAS"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["REQUIRES"], found["EXTRAS"]


def _name(requirement: str) -> str:
    return _norm(re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0))


def _closure(requirements) -> set[str]:
    """Distributions installed by `requirements` and (recursively) their own
    requirements, extras' requirements excluded."""
    todo, seen = [_name(r) for r in requirements], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in reqs if "extra ==" not in r.replace('"', "").replace("'", "")]
    return seen


# One interpreter for the top package, the light packages and the core packages, in
# that order (each stage's code imports everything the stages before it import, so
# each stage's modules are exactly its own code's: `_imported_stages`).
CORE_CHAIN = ("import ac2_jax", "ac2_jax.losses.aggregate_loss",
              "import ac2_jax.losses, ac2_jax.segments, ac2_jax.trace",
              "; ".join(f"import ac2_jax.{p}" for p in CORE),
              "; ".join([*(f"import ac2_jax.{p}" for p in CORE), "import tempfile",
                         "from ac2_jax.training.core import MetricsLogger",
                         "log = MetricsLogger(tempfile.mkdtemp(), console=False)",
                         "log.log(1, {'loss': 1.0}); log.close()"]))


def test_light_packages_import_no_server_plotting_or_torch():
    mods = _imported_stages(*CORE_CHAIN)[2]
    heavy = sorted(m for m, dists in mods.items() if m in HEAVY or HEAVY & {_norm(d) for d in dists})
    assert not heavy, f"import ac2_jax.losses, .segments, .trace pulled {heavy}"


def test_a_trainers_metrics_logger_imports_no_torch():
    """Its TensorBoard files come from `training.core._tfevents`: tensorboardX imported
    torch (1.5-2.3 CPU s at the start of every process that trains)."""
    mods = _imported_stages(*CORE_CHAIN)[4]
    assert not {"torch", "tensorboardX"} & set(mods), sorted({"torch", "tensorboardX"} & set(mods))


def test_text_imports_no_jax():
    """Reading a model's text (tokenizer, chat template, tool calls) needs no model code."""
    mods = _imported("import ac2_jax.text, ac2_jax.text.tiny_tokenizer; "
                     "from ac2_jax.text.tokenizer import choose_tool_parser; "
                     "choose_tool_parser(None, 'llama')")
    assert not {"jax", "jaxlib", "flax"} & set(mods), sorted(mods)


def test_the_top_package_loads_subpackages_on_first_use():
    top, losses = _imported_stages(*CORE_CHAIN)[:2]  # import ac2_jax; then ac2_jax.losses.x
    assert set(top) == {"ac2_jax"}
    assert "jax" in losses and "fastapi" not in losses


def test_trace_pages_import_no_matplotlib():
    pages, curves = _imported_stages("import ac2_jax.viz; ac2_jax.viz.write_trace_html",
                                     "ac2_jax.viz.plot_curves")
    assert "matplotlib" not in pages
    assert "matplotlib" in curves  # the lazy name really loads the curves


def test_core_packages_need_only_the_core_requirements():
    requires, extras = _setup_lists()
    core = _closure(requires)
    assert not core & HEAVY, f"core requirements pull {sorted(core & HEAVY)}"
    assert {"fastapi", "uvicorn"} <= {_name(r) for r in extras["serve"]}
    assert "matplotlib" in {_name(r) for r in extras["viz"]}
    mods = _imported_stages(*CORE_CHAIN)[3]  # import ac2_jax.<each of CORE>
    outside = {m: dists for m, dists in mods.items()
               if dists and m != "ac2_jax" and m not in PROBED
               and not core & {_norm(d) for d in dists}}
    assert not outside, (f"ac2_jax.{{{','.join(CORE)}}} import modules from distributions "
                         f"that setup.py REQUIRES does not install: {outside}")


def _package_imports(package: str) -> list[tuple[str, str | None, int]]:
    """(name, alias or None, line) of each `from ac2_jax.<package>... import` at the top
    level of the package's `__init__`."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    if not init.exists():  # a module, e.g. ac2_jax.seeds
        init = ROOT.joinpath(*package.split(".")).with_suffix(".py")
    out = []
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"ac2_jax.{package}"):
            out += [(a.name, a.asname, node.lineno) for a in node.names]
    return out


@pytest.mark.parametrize("package", PUBLIC)
def test_the_public_api_is_curated(package):
    pkg = importlib.import_module(f"ac2_jax.{package}")
    names = list(pkg.__all__)
    assert len(names) <= MAX_NAMES, (
        f"ac2_jax.{package}.__all__ has {len(names)} names (at most {MAX_NAMES}): keep what a "
        "user needs; the rest stays importable from its module")
    foreign = []
    for name in names:
        obj = getattr(pkg, name)  # every listed name resolves
        own = inspect.isclass(obj) or inspect.isfunction(obj)
        home = obj.__module__ if own else None
        if home is not None and not home.startswith("ac2_jax."):
            foreign.append(f"{name} (from {home})")
    assert not foreign, f"ac2_jax.{package}.__all__ re-exports names it does not own: {foreign}"
    undeclared = [f"{name} (line {line})" for name, alias, line in _package_imports(package)
                  if alias is None and name not in names]
    assert not undeclared, (
        f"ac2_jax.{package}/__init__.py imports {undeclared} as API but __all__ does not list "
        "them: add them to __all__, or import them `as` themselves to keep them importable "
        "without making them API")


# Exported functions named like a submodule of their package: `import ac2_jax.viz.trace_html`
# then gives the function, not the module. None may be added; these wait for the folder moves
# of issue 62 step 3 (the recipes' modules went private: `recipes.rl` is the function alone;
# `models.attention`'s module moved to models/kernels/ and its old path is a deprecation alias
# (ac2_jax/_deprecation.py MOVED_MODULES) until the next release, then this entry goes).
KNOWN_SHADOWS = {"models.attention", "orchestration.gym_env", "orchestration.openenv_env",
                 "orchestration.textarena_env", "orchestration.verifiers_env", "evals.audit",
                 "viz.trace_html"}


def test_no_exported_name_shadows_a_submodule():
    import importlib.util

    shadows = {f"{p}.{n}" for p in PUBLIC
               if hasattr(importlib.import_module(f"ac2_jax.{p}"), "__path__")
               for n in importlib.import_module(f"ac2_jax.{p}").__all__
               if importlib.util.find_spec(f"ac2_jax.{p}.{n}") is not None}
    assert shadows <= KNOWN_SHADOWS, (
        f"exported names that shadow their own submodule: {sorted(shadows - KNOWN_SHADOWS)}; "
        "make the module private (`_name.py`) or rename one of them")


def test_the_public_api_stays_small():
    total = sum(len(importlib.import_module(f"ac2_jax.{p}").__all__) for p in PUBLIC)
    assert total <= MAX_TOTAL, f"{total} names in the packages' __all__ (at most {MAX_TOTAL})"
