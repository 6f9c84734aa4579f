"""Imports run one way (``docs/architecture.md``).

* :mod:`qos` imports nothing of ours (not ``proxy``, ``engine_server``, ``bench``,
  ``tests``).
* Each subpackage of ``proxy/`` imports only the sibling subpackages its ``__init__``
  docstring names on its ``May import:`` line; :data:`ALLOWED` is that graph, and the
  docstrings must say the same. No subpackage imports the entry points at the top of
  ``proxy/`` (:data:`TOP`), nor ``engine_server``, ``bench`` or ``tests``.
* No import cycles: neither between subpackages nor between modules.

Every import counts: at module level, inside functions, and under ``if TYPE_CHECKING:``
(a type-only import is still a dependency a reader must follow). Read with :mod:`ast`
from the source files; nothing is imported.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OURS = ("proxy", "qos", "engine_server", "bench", "tests")

#: subpackage of ``proxy`` -> the sibling subpackages it may import. Bottom up; each
#: ``proxy/<name>/__init__.py`` says the same on its ``May import:`` line.
ALLOWED: dict[str, frozenset[str]] = {
    "config": frozenset(),
    "wire": frozenset(),
    "telemetry": frozenset(),
    "shared": frozenset({"config"}),
    "routing": frozenset({"config", "wire"}),
    "admission": frozenset({"config", "wire", "routing", "shared"}),
    "relay": frozenset({"config", "wire", "telemetry"}),
    "runtime": frozenset({"config", "wire", "telemetry", "shared", "routing", "admission", "relay"}),
    "api": frozenset({"config", "wire", "telemetry", "routing", "admission", "relay", "runtime"}),
}
#: The modules at the top of ``proxy/``: the entry points. They may import any subpackage
#: (and ``engine_server``: ``llm-qos engine`` and ``up``); no subpackage imports them.
TOP = frozenset({"proxy", "proxy.__main__", "proxy.cli", "proxy.server"})


@dataclass(frozen=True)
class Import:
    """One import in a module: the module it names, absolute, and where."""

    target: str
    line: int


def module_name(path: Path) -> str:
    """``proxy/relay/relay.py`` -> ``proxy.relay.relay``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(package: str) -> dict[str, Path]:
    """Every module under ``package`` (a top-level directory of the repository), by name."""
    return {module_name(p): p for p in sorted((REPO / package).rglob("*.py"))}


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> list[Import]:
    """The modules ``source`` (the text of module ``name``) imports, absolute.

    ``from X import a`` names ``X.a`` when that is a module in ``known`` (``from ..telemetry
    import metrics`` imports the module ``metrics``), else ``X``.
    Relative imports are resolved against the module's package.
    """
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                found.append(Import(f"{target}.{a.name}" if f"{target}.{a.name}" in known else target, node.lineno))
    return found


def subpackage_of(module: str) -> str | None:
    """``proxy.relay.sse`` -> ``relay``; ``None`` for the modules at the top of ``proxy``."""
    if module in TOP:
        return None
    return module.split(".")[1]


def violations(name: str, source: str, is_package: bool, known: set[str]) -> list[str]:
    """Every import of module ``name`` (in a subpackage of ``proxy``) that runs the wrong
    way, as ``module:line: why``; empty when all are allowed."""
    own = subpackage_of(name)
    assert own is not None
    wrong = []
    for imp in imports_of(name, source, is_package, known):
        top = imp.target.split(".")[0]
        if top in ("engine_server", "bench", "tests"):
            wrong.append(f"{name}:{imp.line}: imports {imp.target} (only the entry points may use {top})")
        elif top != "proxy":
            continue
        elif imp.target in TOP:
            wrong.append(f"{name}:{imp.line}: imports the entry point {imp.target}")
        elif (other := subpackage_of(imp.target)) != own and other not in ALLOWED[own]:
            wrong.append(f"{name}:{imp.line}: imports {imp.target}, but proxy.{own} may import only {sorted(ALLOWED[own]) or 'nothing of the proxy'}")
    return wrong


def proxy_modules() -> dict[str, Path]:
    return modules_of("proxy")


def module_graph() -> dict[str, set[str]]:
    """module -> the modules of ``proxy`` and ``qos`` it imports."""
    mods = {**proxy_modules(), **modules_of("qos")}
    known = set(mods)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {i.target for i in imports_of(name, path.read_text(), path.name == "__init__.py", known)}
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path whose last node is its first, or ``None``."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_qos_imports_nothing_of_ours():
    mods = modules_of("qos")
    assert len(mods) > 5
    wrong = [
        f"{name}:{imp.line}: imports {imp.target}"
        for name, path in mods.items()
        for imp in imports_of(name, path.read_text(), path.name == "__init__.py", set(mods))
        if imp.target.split(".")[0] in OURS and imp.target.split(".")[0] != "qos"
    ]
    assert wrong == []


def test_every_proxy_module_has_a_place():
    """A module is an entry point at the top or lives in a subpackage the graph knows: a
    new subpackage needs its line in :data:`ALLOWED` and its ``May import:``."""
    placed = [n for n in proxy_modules() if n not in TOP and subpackage_of(n) not in ALLOWED]
    assert placed == []
    packages = {p.parent.name for p in (REPO / "proxy").glob("*/__init__.py")}
    assert packages == set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_subpackage_says_what_it_may_import(package):
    """The ``May import:`` line of ``proxy/<package>/__init__.py`` names exactly the
    subpackages of :data:`ALLOWED` (``nothing`` for none)."""
    doc = ast.get_docstring(ast.parse((REPO / "proxy" / package / "__init__.py").read_text()))
    assert doc, f"proxy/{package}/__init__.py has no docstring"
    lines = [line for line in doc.splitlines() if line.startswith("May import:")]
    assert len(lines) == 1, f"proxy/{package}/__init__.py: one 'May import:' line"
    words = set(re.findall(r"[a-z_]+", lines[0].removeprefix("May import:")))
    said = words & set(ALLOWED)
    if not said:
        assert "nothing" in words, lines[0]
    assert said == ALLOWED[package]


def test_subpackages_import_only_what_they_may():
    mods = proxy_modules()
    known = set(mods)
    wrong = [
        v
        for name, path in mods.items()
        if name not in TOP
        for v in violations(name, path.read_text(), path.name == "__init__.py", known)
    ]
    assert wrong == []


def test_the_check_sees_a_wrong_import():
    """The check is not vacuous: an import up the layers, a type-only one, one inside a
    function and one of an entry point are each caught; an allowed one is not."""
    known = set(proxy_modules())
    wrong = [
        "from ..api.handlers import STATE\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..runtime.state import ProxyState\n",
        "def f():\n    from ..relay import relay\n",
        "from .. import server\n",
        "import proxy.admission.admission\n",
        "from proxy.telemetry.metrics import OUTCOME_OK\n",
        "from engine_server.fleet import plan_engines\n",
    ]
    for source in wrong:
        assert violations("proxy.routing.example", source, False, known), source
    right = "from .. import config\nfrom ..config.pools import PoolSpec\nfrom ..wire.errors import error_response\nfrom .router import PoolRouter\nimport qos\n"
    assert violations("proxy.routing.example", right, False, known) == []


def test_no_cycles_between_subpackages():
    graph: dict[str, set[str]] = {p: set() for p in ALLOWED}
    for module, targets in module_graph().items():
        if module.startswith("proxy.") and module not in TOP:
            graph[subpackage_of(module)] |= {
                subpackage_of(t) for t in targets if t.startswith("proxy.") and t not in TOP and subpackage_of(t) != subpackage_of(module)
            }
    assert find_cycle(graph) is None
    assert find_cycle({p: set(a) for p, a in ALLOWED.items()}) is None


def test_no_cycles_between_modules():
    assert find_cycle(module_graph()) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_every_subpackage_ships():
    """``pyproject.toml`` lists packages by name: a subpackage missing there would be left
    out of the wheel (an editable install would not notice)."""
    packages = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {module_name(p.parent) for p in (REPO / "proxy").rglob("__init__.py")}
    assert on_disk <= packages
