"""No module reads another module's private members: a name with a leading underscore that one of the package's
classes defines (a method, or an attribute set on ``self``) is used only inside that class's own module.

A file of strategy methods moved out, reading ``strategy._x``, is what this catches; objects of other libraries
(torch's ``_foreach_*``, torchmetrics' counters) are not the package's and are listed in ``plugin/compat.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_avgpipe"


# reads of other libraries' private members that share a name with one of ours (file, name): torch's
# ProcessGroup options keep their timeout in ``_timeout``; the standard library's ``os._exit``
OTHER_LIBRARIES = {
    ("lightning_avgpipe/runtime/comms/topology.py", "_timeout"),
    ("lightning_avgpipe/plugin/process/launcher.py", "_exit"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module's classes define: their methods and the attributes they set on ``self``."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, (ast.Attribute)) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self" and _private(node.attr):
                    names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _private(node.target.id):
                names.add(node.target.id)
    return names


def foreign_reads(trees: dict[str, ast.AST]) -> list[str]:
    """``file:line obj._name`` for each read of a private name that only other modules' classes define."""
    owners: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for name in defined_privates(tree):
            owners.setdefault(name, set()).add(path)
    wrong = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in owners):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if path not in owners[node.attr] and (path, node.attr) not in OTHER_LIBRARIES:
                base = node.value.id if isinstance(node.value, ast.Name) else "..."
                wrong.append(f"{path}:{node.lineno} {base}.{node.attr} (defined in {sorted(owners[node.attr])})")
    return wrong


def package_trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_reads_another_modules_private_members() -> None:
    wrong = foreign_reads(package_trees())
    assert not wrong, "use a public member, or move the code into the owner's module: " + "; ".join(wrong)


def test_the_check_sees_a_strategy_method_moved_out() -> None:
    trees = package_trees()
    trees["lightning_avgpipe/plugin/moved.py"] = ast.parse("def step(strategy):\n    return strategy._topology_of\n")
    assert foreign_reads(trees) == [
        "lightning_avgpipe/plugin/moved.py:2 strategy._topology_of "
        "(defined in ['lightning_avgpipe/plugin/strategy.py'])"
    ]
