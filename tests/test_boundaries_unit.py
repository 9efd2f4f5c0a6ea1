"""Import boundaries between the process kinds, read from the source with ``ast``.

One package per process kind: none imports another process's package (they
meet only in servectl/wire, which needs nothing but msgspec, the standard
library and servectl.config). Every import counts, also one inside a function
and ``importlib.import_module("...")`` with a literal name. A second test
imports what the CLI, manager and gateway import and checks that neither vLLM
nor torch came with it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PROCESS_PACKAGES = {"manager", "engine_core", "api_gateway"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of_source(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module a source file imports (absolute dotted names)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            found.add(target)
            # `from servectl import config` imports servectl.config: count the submodule too
            found.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def imports_of(path: Path) -> set[str]:
    return imports_of_source(path.read_text(), module_name(path), path.name == "__init__.py")


def sources(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    return files


def top(name: str) -> str:
    return name.split(".")[0]


def offending(package: str, forbidden: set[str]) -> dict[str, list[str]]:
    bad = {}
    for path in sources(package):
        hits = sorted(n for n in imports_of(path) if top(n) in forbidden)
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


# ---- the checker itself ------------------------------------------------------------------

def test_the_checker_sees_every_form_of_import():
    src = textwrap.dedent("""
        import a.b, c as d
        from e.f import g
        from . import sibling
        from .mod import thing
        from .. import up
        def later():
            import engine_core.core
            importlib.import_module("api_gateway.app")
            __import__("manager")
    """)
    found = imports_of_source(src, "pkg.sub.mod")
    assert {"a.b", "c", "e.f", "pkg.sub.sibling", "pkg.sub.mod", "pkg.up", "engine_core.core",
            "api_gateway.app", "manager"} <= found
    assert imports_of_source("from . import x", "pkg", is_package=True) == {"pkg", "pkg.x"}


def test_the_checker_finds_what_each_package_is_known_to_import():
    """Positive control: the scan is not vacuous."""
    def all_imports(package):
        return set().union(*(imports_of(p) for p in sources(package)))

    assert "servectl.wire.control" in all_imports("manager")
    assert "servectl.wire.engine" in all_imports("api_gateway")
    assert any(top(n) == "vllm" for n in all_imports("engine_core"))  # inside functions
    assert "msgspec" in all_imports("servectl/wire")


# ---- the boundaries -----------------------------------------------------------------------

@pytest.mark.parametrize("package", sorted(PROCESS_PACKAGES))
def test_no_process_package_imports_another(package):
    assert offending(package, PROCESS_PACKAGES - {package}) == {}


def test_servectl_imports_no_process_package():
    """cli, client, library, config, paths, proc, doctor, wire: what every process kind may use."""
    assert offending("servectl", PROCESS_PACKAGES) == {}


def test_wire_needs_only_msgspec_the_standard_library_and_config():
    allowed_stdlib = set(sys.stdlib_module_names)
    bad = {}
    for path in sources("servectl/wire"):
        extra = sorted(n for n in imports_of(path)
                       if top(n) not in allowed_stdlib and top(n) not in ("msgspec", "__future__")
                       and n != "servectl" and not n.startswith(("servectl.config", "servectl.wire")))
        if extra:
            bad[str(path.relative_to(ROOT))] = extra
    assert bad == {}


# ---- the worker hop: one package behind one surface ---------------------------------------------

HOP = "engine_core.workers"


def hop_files() -> set[str]:
    """The modules inside the hop's package (not its ``__init__``, the public surface)."""
    found = {f"{HOP}.{p.stem}" for p in (ROOT / "engine_core" / "workers").glob("*.py") if p.stem != "__init__"}
    assert f"{HOP}.group" in found and f"{HOP}.worker" in found
    return found


def past_the_surface(imports: set[str], private: set[str]) -> list[str]:
    return sorted(n for n in imports if any(n == m or n.startswith(m + ".") for m in private))


def test_the_hop_check_sees_an_import_past_the_surface():
    private = hop_files()
    src = "from engine_core.workers.group import WorkerGroup\nfrom engine_core.workers import WorkerHung\n" \
          "from engine_core import workers\ndef f():\n    import engine_core.workers.link\n"
    assert past_the_surface(imports_of_source(src, "engine_core.main"), private) == [
        "engine_core.workers.group", "engine_core.workers.group.WorkerGroup", "engine_core.workers.link"]


def test_code_outside_the_worker_hop_imports_only_its_public_surface():
    """engine_core/workers/ (the executor, the group, the framing, signing, the worker's loop) is
    used from outside through ``engine_core.workers`` alone, never its files. Tests are excepted:
    they test the files themselves (tests/hop_fixtures.py and the hop's *_unit.py)."""
    private = hop_files()
    bad = {}
    for package in ("engine_core", "manager", "api_gateway", "servectl", "bench", "tools"):
        for path in sources(package):
            if (ROOT / "engine_core" / "workers") in path.parents:
                continue
            hits = past_the_surface(imports_of(path), private)
            if hits:
                bad[str(path.relative_to(ROOT))] = hits
    assert bad == {}


def test_the_hop_surface_is_what_it_says():
    import engine_core.workers as hop

    assert all(hasattr(hop, name) for name in hop.__all__)
    assert not set(hop.__all__) & {m.rsplit(".", 1)[1] for m in hop_files()}  # no name shadows a file


def test_cli_manager_and_gateway_load_no_vllm_or_torch():
    """Import every module of servectl, manager and api_gateway (not engine_core: it is
    the one that runs vLLM) in a fresh interpreter, then look at sys.modules."""
    code = textwrap.dedent("""
        import importlib, json, pkgutil, sys
        imported, failed = [], {}
        for pkg in ("servectl", "manager", "api_gateway"):
            for info in [pkgutil.ModuleInfo(None, pkg, True), *pkgutil.walk_packages(
                    importlib.import_module(pkg).__path__, pkg + ".")]:
                if info.name.endswith(".__main__"):
                    continue  # runs the process
                try:
                    importlib.import_module(info.name)
                    imported.append(info.name)
                except Exception as exc:
                    failed[info.name] = f"{type(exc).__name__}: {exc}"
        for name in ("servectl.cli", "servectl.config", "servectl.wire.control", "servectl.wire.engine",
                     "servectl.wire.spawn"):
            importlib.import_module(name)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch"))
        print(json.dumps({"imported": imported, "failed": failed, "heavy": heavy}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["failed"] == {}
    assert {"servectl.cli", "servectl.wire.spawn", "manager.children", "api_gateway.engines"} <= set(
        result["imported"])
    assert result["heavy"] == [], f"loaded with the CLI/manager/gateway modules: {result['heavy'][:10]}"


# ---- no circle of imports inside a folder ----------------------------------------------
# A circle inside a folder means two files that each need the other: a child that
# knows its parent. Every import counts (inside functions and under TYPE_CHECKING
# too); circles between folders are the boundary tests' business above.

PRODUCT = ("servectl", "manager", "engine_core", "api_gateway")


def module_files() -> dict[str, Path]:
    return {module_name(path): path for package in PRODUCT for path in sources(package)}


def folder_edges(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of its own folder it imports (a package's __init__ is in its folder)."""
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        here = path.parent
        names = imports_of(path)
        # `from pkg import module` imports pkg only because Python imports a parent
        # first: the edge is to the module, not to pkg's __init__
        names -= {name for name in names if any(other.startswith(name + ".") for other in names & files.keys())}
        edges[module] = {name for name in names
                         if name in files and name != module and files[name].parent == here}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected parts of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_circle_finder_sees_an_import_inside_a_function():
    source = "def later():\n    from manager import daemon\n"
    assert "manager.daemon" in imports_of_source(source, "manager.control")


def test_no_circle_of_imports_inside_any_folder():
    found = circles(folder_edges(module_files()))
    assert found == [], "files of one folder that import each other (hand the child an interface): " \
        + "; ".join(" <-> ".join(part) for part in found)
