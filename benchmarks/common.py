"""Helpers the benchmarks share: GPT training batches from the corpus, applying a stage's layers, the LM loss,
Spearman's rank correlation, and the writer of ``benchmarks/history/*.json`` records."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HISTORY = Path(__file__).resolve().parent / "history"
NOTE_LIMIT = 200  # a record's note is one sentence on one line; what a run showed goes to README.md's run history


def make_batches(data: Tensor, block_size: int, batch_size: int, count: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """``count`` batches of random windows of the corpus: inputs ``(B, T)`` and next-character targets."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=g).tolist()
        x = torch.stack([data[s : s + block_size] for s in starts])
        y = torch.stack([data[s + 1 : s + block_size + 1] for s in starts])
        batches.append((x, y))
    return batches


def apply_layers(layers: list[nn.Module], x: Any) -> Any:
    """A stage's layers applied in order."""
    for layer in layers:
        x = layer(x)
    return x


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's on the ranks); nan for fewer than 2 points or a constant side."""
    if len(x) < 2:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else math.nan


def check_note(note: str) -> str:
    """``note`` if it is one line of at most ``NOTE_LIMIT`` characters, else ``ValueError``. Nothing is trimmed: a
    summary cut short says less than one written to fit; the prose goes to benchmarks/README.md's run history."""
    if not note.strip():
        raise ValueError("a history note is a one-sentence summary of the run; this one is empty")
    if "\n" in note or "\r" in note:
        raise ValueError(f"a history note is one line, this one has {len(note.splitlines())}: {note[:80]!r}...")
    if len(note) > NOTE_LIMIT:
        raise ValueError(f"a history note is at most {NOTE_LIMIT} characters, this one has {len(note)}")
    return note


def append_history(benchmark: str, record: dict[str, Any], directory: Path = HISTORY) -> Path:
    """Append ``record`` (``date``, ``title``, ``command``, ``figures``, ``note``) to ``<directory>/<benchmark>.json``,
    a list of dated runs; refuses a record without those keys or with a note ``check_note`` refuses."""
    missing = [key for key in ("date", "title", "command", "figures", "note") if key not in record]
    if missing:
        raise ValueError(f"a history record needs {missing}")
    check_note(record["note"])
    path = directory / f"{benchmark}.json"
    records = json.loads(path.read_text()) if path.exists() else []
    records.append(record)
    path.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    return path
