"""The documentation builds with ``mkdocs build --strict``, and every schedule command it quotes runs as shown."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
COMMAND = "python -m lightning_avgpipe schedule"
# A quoted command ends at the end of its line or at the closing backtick of inline code.
_COMMAND_RE = re.compile(re.escape(COMMAND) + r"[^`\n]*")
_FENCE_RE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def quoted_commands() -> list[str]:
    """Every distinct ``python -m lightning_avgpipe schedule ...`` command in the docs, in order of appearance."""
    seen: dict[str, None] = {}
    for page in _pages():
        for match in _COMMAND_RE.finditer(page.read_text()):
            seen[match.group(0).strip()] = None
    return list(seen)


def transcripts() -> list[tuple[str, str, str]]:
    """Fenced blocks that start with ``$ python -m lightning_avgpipe schedule ...``: (page, command, output)."""
    found = []
    for page in _pages():
        for block in _FENCE_RE.finditer(page.read_text()):
            first, _, rest = block.group(1).partition("\n")
            if first.startswith("$ " + COMMAND):
                found.append((page.name, first[2:].strip(), rest))
    return found


@cache
def run_command(command: str) -> subprocess.CompletedProcess[str]:
    """Run a quoted command from the repository root with this interpreter (once per distinct command)."""
    argv = shlex.split(command)
    assert argv[0] == "python", command
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed; `pip install -e .[docs]` to build the docs")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "WARNING" in line]
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "index.html").exists()


def test_docs_quote_schedule_commands() -> None:
    assert quoted_commands(), f"no `{COMMAND}` found in {DOCS}"
    assert transcripts(), f"no fenced `$ {COMMAND}` transcript found in {DOCS}"


@pytest.mark.parametrize("command", quoted_commands(), ids=lambda c: c[len(COMMAND) :].strip() or "defaults")
def test_quoted_schedule_command_runs(command: str) -> None:
    proc = run_command(command)
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize(
    ("page", "command", "output"), transcripts(), ids=[f"{p}:{c[len(COMMAND) :].strip()}" for p, c, _ in transcripts()]
)
def test_quoted_schedule_output_is_current(page: str, command: str, output: str) -> None:
    """The output pasted under a command is what the command prints today (trailing spaces aside)."""
    proc = run_command(command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _lines(proc.stdout) == _lines(output), (
        f"{page}: the output quoted under `{command}` is out of date; paste the current output:\n{proc.stdout}"
    )


def test_the_docs_stay_an_evenings_read() -> None:
    """docs/ at most 130 KB and benchmarks/README.md at most 400 lines: what grows must replace prose."""
    size = sum(p.stat().st_size for p in DOCS.rglob("*") if p.is_file())
    assert size <= 130_000, f"docs/ is {size} bytes; cut prose to at most 130,000 (a table or the code may do)"
    lines = len((ROOT / "benchmarks" / "README.md").read_text().splitlines())
    assert lines <= 400, f"benchmarks/README.md has {lines} lines; history belongs in benchmarks/history/*.json"


def _long_notes(path: Path, limit: int) -> list[str]:
    """The records of a history file whose ``note`` is more than one line or longer than ``limit`` characters."""
    return [
        f"{path.name}[{i}]: {len(note.splitlines())} line(s), {len(note)} characters"
        for i, note in enumerate(record["note"] for record in json.loads(path.read_text()))
        if "\n" in note or "\r" in note or len(note) > limit
    ]


def test_every_benchmark_history_note_is_one_line(tmp_path: Path) -> None:
    """A record's ``note`` in benchmarks/history/*.json is a one-sentence summary on one line; what the run showed is
    a row of benchmarks/README.md's run history. The writer, ``benchmarks.common.append_history``, refuses others."""
    from benchmarks.common import NOTE_LIMIT, append_history

    files = sorted((ROOT / "benchmarks" / "history").glob("*.json"))
    assert files, "no benchmarks/history/*.json"
    long = [entry for path in files for entry in _long_notes(path, NOTE_LIMIT)]
    assert not long, f"history notes over one line or {NOTE_LIMIT} characters (move the prose to the README): {long}"
    record = {"date": "2026-12-04", "title": "t", "command": "c", "figures": {}, "note": "a summary\nand prose"}
    (tmp_path / "sample.json").write_text(json.dumps([record]))
    assert _long_notes(tmp_path / "sample.json", NOTE_LIMIT), "the check let a two-line note through"
    with pytest.raises(ValueError, match="one line"):
        append_history("refused", record, tmp_path)
    assert not (tmp_path / "refused.json").exists()


def test_the_docs_name_every_logged_figure_every_reconfigure_argument_and_the_checkpoints_keys() -> None:
    """Claims the code holds the docs to: each ``avgpipe/...`` figure the package logs has a row in the strategy
    page's table; ``reconfigure``'s signature there lists every argument; the checkpoint's own keys are named."""
    import inspect

    from lightning_avgpipe import AvgPipeStrategy

    page = (DOCS / "strategy.md").read_text()
    source = "".join(p.read_text() for p in (ROOT / "lightning_avgpipe").rglob("*.py"))
    logged = set(re.findall(r'"(avgpipe/[a-z_/]+(?:\{s\})?)', source))
    assert logged, "no logged figure found in the package"
    rows = set(re.findall(r"^\| `(avgpipe/[^`]+)`(?:, `(avgpipe/[^`]+)`)?", page, re.MULTILINE))
    documented = {name for row in rows for name in row if name}
    assert logged <= documented, f"logged but not in docs/strategy.md's table: {sorted(logged - documented)}"
    call = re.search(r"`strategy\.reconfigure\(([^`]*)\)`", page)
    assert call is not None, "docs/strategy.md gives no strategy.reconfigure(...) call"
    named = set(re.findall(r"(\w+)=", call.group(1)))
    arguments = set(inspect.signature(AvgPipeStrategy.reconfigure).parameters) - {"self"}
    assert named == arguments, f"documented reconfigure({sorted(named)}) != its signature {sorted(arguments)}"
    for key in ("avgpipe_layout", "avgpipe_ranks", "state_dict", "optimizer_states", "param_names"):
        assert f"`{key}`" in page, key


def rooms_map(text: str) -> dict[str, tuple[str, ...] | None]:
    """docs/how-it-works.md#rooms: folder -> what it may import of its package, as paths under the package (``None``:
    every room)."""
    section = text.split("## Rooms {#rooms}", 1)[1].split("\n## ", 1)[0]
    found: dict[str, tuple[str, ...] | None] = {}
    for row in re.findall(r"^\| `([\w/]+)/` \|[^|]*\| ([^|]*) \|$", section, re.MULTILINE):
        folder, may = row
        package = folder.rpartition("/")[0]  # its entries' paths are under the room's package
        entries = tuple(f"{package}/{e.rstrip('/')}".lstrip("/") for e in re.findall(r"`([\w/.]+)`", may))
        found[folder] = None if may.strip() == "every room" else entries
    return found


def test_the_map_of_rooms_is_the_tree() -> None:
    """The map that opens docs/how-it-works.md names every folder of plugin/ and runtime/ and algorithms/ (and no
    other), and for each room exactly what ``tests/helpers/layers.py`` lets it import (``tests/test_import_layers.py``
    checks the rule)."""
    from tests.helpers.layers import ROOMS

    shown = rooms_map((DOCS / "how-it-works.md").read_text())
    package = ROOT / "lightning_avgpipe"
    tree = {
        str(d.relative_to(package)) for top in ("plugin", "runtime") for d in (package / top).iterdir() if d.is_dir()
    } - {"plugin/__pycache__", "runtime/__pycache__"}
    tops = {"plugin", "runtime", "algorithms"}
    assert set(shown) == tree | tops, sorted(set(shown) ^ (tree | tops))
    assert shown["plugin"] is None and shown["runtime"] is None
    wrong = {room: (shown[room], ROOMS[room]) for room in ROOMS if set(shown[room] or ()) != set(ROOMS[room])}
    assert not wrong, f"the map's 'may import' (shown, the rule) differ: {wrong}"


def test_the_rooms_check_sees_a_missing_row() -> None:
    text = (DOCS / "how-it-works.md").read_text()
    shown = rooms_map(text.replace("| `runtime/files/` |", "| `runtime/filez/` |"))
    assert "runtime/filez" in shown and "runtime/files" not in shown
