"""Imports only point down: a module of reasoning_engine imports its own package and the layers below it, never a
layer above nor a neighbour in its own layer, and no modules import each other in a circle. Every import counts,
those inside functions and under TYPE_CHECKING too. LAYERS is the layering docs/ARCHITECTURE.md draws, and that
document's package table names every module."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = "reasoning_engine"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Top to bottom. A name is a subpackage (all its modules) or a top-level module of reasoning_engine; "__init__" is
# reasoning_engine/__init__.py (the public names). A module may import its own unit and the units of lower layers.
LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("commands",),
    ("generate_cli", "bench", "tiny", "router"),  # commands and tools over the public API; router: over servers' HTTP
    ("server",),
    ("__init__",),
    ("llm",),
    ("engine",),
    ("speculative",),
    ("adaptive", "multimodal"),
    ("models",),
    ("layers",),
    ("kernels",),
    ("config", "cache_groups", "batch", "parallel", "sampling_params", "outputs"),  # plain data every layer reads
    ("quant_config", "structured"),
]
LAYER_OF = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}


def package_sources() -> dict[str, str]:
    """Every module of the package: dotted name -> source."""
    sources = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        sources[name] = path.read_text()
    return sources


@functools.lru_cache(maxsize=None)
def import_statements(source: str) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """(level, module, names) of every import in `source`; `import a.b` is (0, "a.b", ())."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((0, alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", tuple(alias.name for alias in node.names)))
    return tuple(found)


def imported_modules(name: str, source: str, modules: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in `source` (a name imported from a package counts as the
    package, unless it is one of its modules)."""
    is_package = name == PACKAGE or any(other.startswith(name + ".") for other in modules)
    found: set[str] = set()
    for level, base, names in import_statements(source):
        if level:
            parts = name.split(".")
            base = ".".join(parts[: len(parts) - level + is_package] + ([base] if base else []))
        found.add(base)
        found.update(f"{base}.{alias}" for alias in names if f"{base}.{alias}" in modules)
        if names and all(f"{base}.{alias}" in modules for alias in names):
            found.discard(base)  # `from package import module`: only the module
    return {target for target in found if target in modules and target != name}


def unit(module: str) -> str:
    """The LAYERS entry a module belongs to: its subpackage or top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(sources: dict[str, str]) -> list[str]:
    """'a -> b' for every import of a unit not below the importer's, and for every module in no layer."""
    problems = []
    for name, source in sorted(sources.items()):
        if unit(name) not in LAYER_OF:
            problems.append(f"{name}: {unit(name)!r} is in no layer of LAYERS")
            continue
        for target in sorted(imported_modules(name, source, set(sources))):
            if unit(target) != unit(name) and LAYER_OF.get(unit(target), -1) <= LAYER_OF[unit(name)]:
                problems.append(f"{name} -> {target}")
    return problems


def import_cycles(sources: dict[str, str]) -> list[list[str]]:
    """The groups of modules that import each other in a circle (strongly connected components of the import
    graph, Tarjan's algorithm, iterative)."""
    graph = {name: sorted(imported_modules(name, source, set(sources))) for name, source in sources.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, edge = work.pop()
            if edge == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if edge < len(graph[node]):
                work.append((node, edge + 1))
                target = graph[node][edge]
                if target not in index:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


def test_every_import_points_down() -> None:
    assert upward_imports(package_sources()) == []


def test_no_modules_import_each_other() -> None:
    assert import_cycles(package_sources()) == []


@pytest.mark.parametrize("module, source, expected", [
    # a kernel reaching up into the engine, inside a function
    ("reasoning_engine.kernels.bad", "def f():\n    from reasoning_engine.engine.engine import LLMEngine\n",
     "reasoning_engine.kernels.bad -> reasoning_engine.engine.engine"),
    # the engine importing the offline API above it
    ("reasoning_engine.engine.bad", "from reasoning_engine.llm import build_engine_config\n",
     "reasoning_engine.engine.bad -> reasoning_engine.llm"),
    # a public name from the package root, in a layer below it
    ("reasoning_engine.models.bad", "from reasoning_engine import SamplingParams\n",
     "reasoning_engine.models.bad -> reasoning_engine"),
    # neighbours in one layer stay apart
    ("reasoning_engine.adaptive.bad", "import reasoning_engine.multimodal.inputs\n",
     "reasoning_engine.adaptive.bad -> reasoning_engine.multimodal.inputs"),
    # a new top-level module needs its place in LAYERS
    ("reasoning_engine.helpers", "import os\n", "reasoning_engine.helpers: 'helpers' is in no layer of LAYERS"),
    # the config reading the models' quantization code
    ("reasoning_engine.config", "from reasoning_engine.models import quantization\n",
     "reasoning_engine.config -> reasoning_engine.models.quantization"),
    # a relative import resolves like an absolute one
    ("reasoning_engine.layers.bad", "from ..engine import scheduler\n",
     "reasoning_engine.layers.bad -> reasoning_engine.engine.scheduler"),
])
def test_an_upward_import_fails(module: str, source: str, expected: str) -> None:
    sources = package_sources()
    sources[module] = source
    assert expected in upward_imports(sources)


def test_downward_and_own_package_imports_pass() -> None:
    sources = package_sources()
    sources["reasoning_engine.engine.fine"] = ("import torch\nfrom reasoning_engine.engine.engine import LLMEngine\n"
                                               "from reasoning_engine.kernels import attention\n")
    assert upward_imports(sources) == []


def test_a_circle_fails() -> None:
    sources = package_sources()
    sources["reasoning_engine.tiny.first"] = "def f():\n    from reasoning_engine.tiny.second import g\n"
    sources["reasoning_engine.tiny.second"] = "from reasoning_engine.tiny import first\n"
    assert ["reasoning_engine.tiny.first", "reasoning_engine.tiny.second"] in import_cycles(sources)


def architecture_rows(doc: str) -> dict[str, str]:
    """ARCHITECTURE.md's package table: each name in a row's first cell (`engine/`, `llm.py`, ...) -> the row."""
    table = doc[doc.index("| package | what lives there |"):]
    table = table[: table.index("\n## ")]
    rows = {}
    for row in re.split(r"\n(?=\| `)", table):
        first_cell = re.match(r"\| (.+?) \|", row)
        for name in re.findall(r"`([\w/.]+)`", first_cell.group(1)) if first_cell else ():
            rows[name] = row
    return rows


def unnamed_modules(doc: str) -> list[str]:
    """The package's modules ARCHITECTURE.md's table leaves out: a subpackage's modules must appear (in backticks)
    in its row, a top-level module must have a row."""
    rows = architecture_rows(doc)
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if path.name == "__init__.py":
            continue
        if len(parts) == 1:
            if path.name not in rows:
                missing.append(path.name)
            continue
        inner = "/".join(parts[1:])
        if not re.search(r"`(?:[\w/]+/)?" + re.escape(inner) + "`", rows.get(parts[0] + "/", "")):
            missing.append(f"{parts[0]}/{inner}")
    return missing


def test_architecture_names_every_module() -> None:
    assert unnamed_modules((ROOT.parent / "docs" / "ARCHITECTURE.md").read_text()) == []


def test_a_module_left_out_of_architecture_is_found() -> None:
    doc = (ROOT.parent / "docs" / "ARCHITECTURE.md").read_text()
    assert unnamed_modules(doc.replace("`index.py` (", "the index (", 1)) == ["speculative/index.py"]
    assert unnamed_modules(doc.replace("| `llm.py` |", "| the offline API |", 1)) == ["llm.py"]
