"""The package's layers import only downward: a module may import its own layer and the layers below it, never one
above (``config.py`` must not pull in the runtime, the runtime not the tuner, the tuner not the plugin).

The order, lowest first: the shared checks; schedules, micro-batches and the noise maths; elastic
averaging, optimizers and the config; the runtime; the tuning maths; partitioning; the Lightning plugin; the command
lines and the package's face. The second and third layers but the schedules and the config are the paper's
algorithms, one room: ``algorithms/``. Every import counts, at module level or inside a function, under
``TYPE_CHECKING`` or not: each is a dependency a reader must follow.

Inside a layer, ``plugin/`` and ``runtime/`` are grouped into rooms by concept (``plugin/checkpoint/``,
``runtime/failures/``, ...): a room imports of its own package only what ``tests/helpers/layers.py``'s ``ROOMS`` lists
(``runtime/failures/`` nothing of the step), and no room holds more than 12 files (``algorithms/`` included).

The tests stand alone as well: what several test modules share lives in ``tests/helpers/``, and no module of
``tests/`` or ``benchmarks/`` imports a test module (``tests/test_*.py``), by an import statement or by a dotted name
a launch imports (``"tests.test_x:worker"``); a test module may name itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.layers import ROOMS, allowed_in_room, layer_of, room_of

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_avgpipe"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, text: str | None = None) -> list[tuple[int, str]]:
    """(line, imported module) for every import of the package's own modules in ``path`` (or in ``text`` read as
    that file)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    source = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from a import b` where a.b is a module imports a.b
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, m) for line, m in found if m.split(".")[0] == "lightning_avgpipe"]


def upward_imports(path: Path, text: str | None = None) -> list[str]:
    """Each import in ``path`` (or in ``text`` read as that file) of a higher layer than its own."""
    wrong = []
    source = module_name(path)
    mine = layer_of(source)
    if mine is not None:
        for line, target in imports_of(path, text):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                where = f"{path.relative_to(ROOT)}:{line}"
                wrong.append(f"{where}: {source} (layer {mine}) imports {target} (layer {theirs})")
    return wrong


def all_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    unplaced = [module_name(p) for p in all_modules() if layer_of(module_name(p)) is None]
    assert not unplaced, f"give these modules a layer in tests/test_import_layers.py: {unplaced}"


def test_no_import_runs_up_the_layers() -> None:
    wrong = [w for path in all_modules() for w in upward_imports(path)]
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(wrong)


def test_config_imports_nothing_from_the_runtime_tuning_or_partition() -> None:
    targets = [t for _, t in imports_of(PACKAGE / "config.py")]
    higher = ("lightning_avgpipe.runtime", "lightning_avgpipe.tuning", "lightning_avgpipe.partition")
    assert not [t for t in targets if t.startswith(higher)], targets


@pytest.mark.parametrize(
    "source, line",
    [
        ("config.py", "from lightning_avgpipe.partition import check_partition"),
        ("runtime/pipeline.py", "from lightning_avgpipe.tuning.model import StageCost"),
        ("schedules/simulate.py", "from lightning_avgpipe.config import PipelineConfig"),
    ],
)
def test_the_check_fails_on_an_upward_import(source: str, line: str) -> None:
    """The check is live: the file with one upward import put back (or added) is refused, naming the import."""
    path = PACKAGE / source
    assert upward_imports(path) == []
    wrong = upward_imports(path, path.read_text() + "\n" + line + "\n")
    assert len(wrong) == 1 and line.split()[1] in wrong[0], wrong


def room_imports(path: Path, text: str | None = None) -> list[str]:
    """Each import in ``path`` (or in ``text`` read as that file) that its room may not make (``ROOMS``)."""
    mine = str(path.relative_to(PACKAGE))
    room = room_of(mine)
    if room is None:
        return []
    modules = {module_name(p): p for p in all_modules()}
    wrong = []
    for line, target in imports_of(path, text):
        parts = target.split(".")
        found = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None)
        if found is None:
            continue
        where = str(modules[found].relative_to(PACKAGE))
        if not allowed_in_room(room, where):
            wrong.append(f"{path.relative_to(ROOT)}:{line}: {room}/ imports {where}")
    return wrong


def test_each_room_imports_only_what_it_may() -> None:
    wrong = [w for path in all_modules() for w in room_imports(path)]
    assert not wrong, "imports a room may not make (tests/helpers/layers.py ROOMS):\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "source, line",
    [
        ("runtime/failures/report.py", "from lightning_avgpipe.runtime.pipeline import StagePipeline"),
        ("runtime/build/materialize.py", "from lightning_avgpipe.runtime.comms.topology import Topology"),
        ("plugin/steps/results.py", "from lightning_avgpipe.plugin.checkpoint import sharded"),
        ("algorithms/elastic.py", "from lightning_avgpipe.config import PipelineConfig"),  # below, not its room's
    ],
)
def test_the_room_check_refuses_an_import_across(source: str, line: str) -> None:
    path = PACKAGE / source
    assert room_imports(path) == []
    wrong = room_imports(path, path.read_text() + "\n" + line + "\n")
    assert len(wrong) == 1 and source.rsplit("/", 1)[0] in wrong[0], wrong


def test_the_rooms_are_the_folders() -> None:
    """Every subpackage of plugin/ and runtime/ is a room of ``ROOMS`` (tuner/ included), and so is ``algorithms/``
    at the package's root; each names what it is and may import in its ``__init__.py``, and none holds more than 12
    files."""
    folders = {
        str(d.relative_to(PACKAGE)) for top in ("plugin", "runtime") for d in (PACKAGE / top).iterdir() if d.is_dir()
    } - {"plugin/__pycache__", "runtime/__pycache__"}
    assert folders | {"algorithms"} == set(ROOMS), (sorted(folders), sorted(ROOMS))
    for room in ROOMS:
        files = sorted((PACKAGE / room).glob("*.py"))
        assert len(files) <= 12, (room, len(files))
        assert "import" in ((PACKAGE / room / "__init__.py").read_text()), f"{room}/__init__.py: say what it may import"


def test_no_package_file_is_over_500_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in all_modules() if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these by concept: {long}"


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (names resolved to existing modules)."""
    modules = {module_name(p): p for p in all_modules()}

    def resolve(target: str) -> str | None:
        parts = target.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in modules:
                return ".".join(parts[:n])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {resolve(t) for _, t in imports_of(path)}
        graph[name] = {t for t in targets if t is not None and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    """No two modules import each other, directly or around a circle (``TYPE_CHECKING`` imports included: a
    strategy method moved to a file that imports the strategy back is still the strategy's)."""
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


def test_the_cycle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


# a test module (tests/test_*.py) as a dotted name, alone or as a launch's "module:function"
TEST_MODULE = re.compile(r"^(tests\.test_\w+)(?:[.:][\w.]*)?$")


def imports_of_test_modules(sources: dict[str, str]) -> list[str]:
    """``path:line imports tests.test_x`` for each import of another test module in ``sources`` (a path relative to
    the repository root -> its text): ``import``, ``from ... import`` (relative ones resolved) and string constants
    that name a test module (a launch's dotted path)."""
    wrong = []
    for path, text in sorted(sources.items()):
        parts = list(Path(path).with_suffix("").parts)
        own = ".".join(parts)
        package = parts[:-1]
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = [*package[: len(package) - (node.level - 1)]] if node.level else []
                base += node.module.split(".") if node.module else []
                names = [".".join(base), *(".".join([*base, alias.name]) for alias in node.names)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            else:
                continue
            found = {m.group(1) for m in map(TEST_MODULE.match, names) if m} - {own}
            wrong += [f"{path}:{node.lineno} imports {module}" for module in sorted(found)]
    return wrong


def sources_in_tests_and_benchmarks() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text()
        for folder in ("tests", "benchmarks")
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


def test_no_test_module_imports_another() -> None:
    wrong = imports_of_test_modules(sources_in_tests_and_benchmarks())
    assert not wrong, "move what the test modules share into tests/helpers/:\n" + "\n".join(wrong)


def test_the_check_finds_a_test_module_imported() -> None:
    """The check is live: a planted test module and benchmark that import test modules every way are refused, line
    by line; imports of tests/helpers and a test module naming itself are not."""
    t = "tests.test_"  # spelled apart, so that a grep for such imports finds none in this file
    sources = sources_in_tests_and_benchmarks()
    sources["tests/test_planted.py"] = "\n".join(
        [
            "from tests.helpers.lit import reference",  # 1: a helper, fine
            f"from {t}runtime_equivalence import CASES",  # 2
            f"import {t}precision as precision",  # 3
            "from tests import test_nodes, helpers",  # 4
            "from .test_launchers import ROOT",  # 5: relative
            "def f():",
            f"    from {t}checkpoint_layouts import TP_PLAN",  # 7: inside a function
            f"    return run('{t}recompute:worker', '{t}planted:own')",  # 8: a launch; itself, fine
        ]
    )
    sources["benchmarks/planted.py"] = f"import os\nimport {t}gpu\n"
    assert imports_of_test_modules(sources) == [
        "benchmarks/planted.py:2 imports tests.test_gpu",
        "tests/test_planted.py:2 imports tests.test_runtime_equivalence",
        "tests/test_planted.py:3 imports tests.test_precision",
        "tests/test_planted.py:4 imports tests.test_nodes",
        "tests/test_planted.py:5 imports tests.test_launchers",
        "tests/test_planted.py:7 imports tests.test_checkpoint_layouts",
        "tests/test_planted.py:8 imports tests.test_recompute",
    ]


def test_the_step_keeps_its_surface_small() -> None:
    """``StagePipeline`` keeps the step's own operations, at most 20 ``def``s (issue 43); callers read its config,
    topology and executor directly, and helpers of one step are functions beside it."""
    import ast

    tree = ast.parse((PACKAGE / "runtime" / "pipeline.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StagePipeline"]
    defs = [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(defs) <= 20, f"StagePipeline has {len(defs)} defs: {defs}"
