"""Lightning's private state is used only through ``lightning_avgpipe/plugin/compat.py``, and compat's docstring says
truly which files use each of its entries ("Used by: ...").

Three checks, each over the package's source (nothing is trusted to a comment):

- no module but compat imports a private name from Lightning;
- no class outside compat overrides a private method of a Lightning base class (Lightning may rename it);
- every entry of compat's list names exactly the files that use it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from lightning_avgpipe.plugin import compat

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_avgpipe"
COMPAT = "lightning_avgpipe.plugin.compat"


def sources() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "compat.py"]


def rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def compat_uses(path: Path, text: str | None = None) -> set[str]:
    """The names of compat that ``path`` uses: ``from ...compat import x`` and ``compat.x``."""
    tree = ast.parse(path.read_text() if text is None else text)
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == COMPAT:
            used |= {a.name for a in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "compat":
            used.add(node.attr)
    return used


def documented() -> dict[str, set[str]]:
    """compat's docstring: entry -> the files its "Used by:" names."""
    doc = compat.__doc__ or ""
    entries: dict[str, set[str]] = {}
    for bullet in re.split(r"\n- ", doc)[1:]:
        text = " ".join(bullet.split())
        name = re.match(r"``(\w+)", text)
        users = re.search(r"Used by: (.*?)\.(?: |$)", text)
        assert name and users, f"compat's docstring entry without a name or 'Used by: ...': {text[:80]}"
        entries[name.group(1)] = set(re.findall(r"``([\w/]+\.py)``", users.group(1)))
    return entries


def actual() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sources():
        for name in compat_uses(path):
            found.setdefault(name, set()).add(rel(path))
    return found


def test_used_by_lists_are_true() -> None:
    doc, real = documented(), actual()
    assert set(doc) == set(compat.__all__), "every name compat exports has one entry, and only those"
    wrong = {n: (sorted(doc.get(n, ())), sorted(real.get(n, ()))) for n in compat.__all__ if doc.get(n) != real.get(n)}
    assert not wrong, f"compat's 'Used by' lists (documented, actual) differ: {wrong}"


def test_the_used_by_check_sees_a_new_use() -> None:
    path = PACKAGE / "plugin" / "tuner" / "callback.py"
    before = compat_uses(path)
    after = compat_uses(path, path.read_text() + "\nfrom lightning_avgpipe.plugin.compat import writes_logs\n")
    assert after - before == {"writes_logs"}


def private_lightning_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("lightning", "pytorch_lightning"):
            found += [f"{rel(path)}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_no_module_but_compat_imports_lightnings_private_names() -> None:
    found = [f for path in sources() for f in private_lightning_imports(path)]
    assert not found, f"import these through lightning_avgpipe/plugin/compat.py: {found}"


PLUGIN_MODULES = sorted(
    "lightning_avgpipe." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    for p in (PACKAGE / "plugin").rglob("*.py")
    if p.stem not in ("compat", "__init__")
) + ["lightning_avgpipe.cli"]


@pytest.mark.parametrize("name", PLUGIN_MODULES)
def test_no_class_overrides_a_private_lightning_method(name: str) -> None:
    module = importlib.import_module(name)
    wrong = []
    for cls in vars(module).values():
        if not inspect.isclass(cls) or cls.__module__ != name:
            continue
        for attr in vars(cls):
            if not attr.startswith("_") or attr.startswith(("__", "_abc_")):  # _abc_impl: the ABC machinery's
                continue
            owners = [b for b in cls.__mro__[1:] if attr in vars(b) and b.__module__.startswith("lightning.")]
            if owners:
                wrong.append(f"{cls.__name__}.{attr} overrides {owners[0].__module__}.{owners[0].__name__}.{attr}")
    assert not wrong, f"override Lightning's private methods only in compat.py: {wrong}"
