"""Reporting a tuning table: the JSON of every prediction and a heat map of samples/s over (M, N).
(Design: docs/how-it-works.md#choosing-m-and-n.)

The heat map has the candidate micro-batch counts M across and the pipeline counts N down; each cell holds the
predicted samples/s (and the early forwards k under ``advance``). Settings that do not fit the memory limit are
grey, hatched and labelled ``OOM``; settings the search did not predict (it stops raising N once no M fits) are
left blank; the chosen setting is outlined. matplotlib is optional: without it no PNG is written.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from lightning_avgpipe.tuning.model import Prediction
from lightning_avgpipe.tuning.search import TuningTable


def _title(table: TuningTable) -> str:
    limit = "none" if table.memory_limit is None else f"{table.memory_limit / 2**20:.1f} MiB"
    title = f"predicted samples/s, schedule={table.schedule}, memory limit={limit}"
    if table.profile is not None:
        title += f"\nS={table.profile.num_stages}, D={table.profile.num_groups}, B={table.profile.batch_size}"
    if table.choice is not None:
        c = table.choice
        title += f"; chosen M={c.num_microbatches}, N={c.num_pipelines}"
        if table.schedule == "advance":
            title += f", k={c.advance_forwards}"
    return title


def _label(r: Prediction, advance: bool) -> str:
    if not r.feasible:
        return f"OOM\n{max(r.peak_bytes) / 2**20:.0f} MiB"
    v = r.samples_per_sec
    value = "inf" if not math.isfinite(v) else f"{v:.1f}" if v < 1000 else f"{v:.0f}"
    return f"{value}\nk={r.advance_forwards}" if advance else value


def write_heatmap(table: TuningTable, path: str | Path) -> Path | None:
    """Write a PNG heat map of ``table``'s predicted samples/s to ``path``; ``None`` when matplotlib is missing.

    M (the candidate micro-batch counts) runs along the x axis, N along the y axis. Infeasible cells are grey,
    hatched and marked ``OOM`` with the largest per-stage need; the chosen cell has a thick red outline. The file
    is written under a temporary name and renamed, so a reader never sees half a PNG.
    """
    try:
        # a Figure with its own Agg canvas: no pyplot, so the user's backend and open figures are left alone
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ms = sorted({r.num_microbatches for r in table.rows})
    ns = sorted({r.num_pipelines for r in table.rows})
    cells = {(r.num_microbatches, r.num_pipelines): r for r in table.rows}
    good = [r.samples_per_sec for r in table.rows if r.feasible and math.isfinite(r.samples_per_sec)]
    lo, hi = (min(good), max(good)) if good else (0.0, 1.0)
    if hi <= lo:
        hi = lo + 1.0
    cmap = matplotlib.colormaps["viridis"]
    advance = table.schedule == "advance"

    fig = Figure(figsize=(max(5.0, 1.1 * len(ms) + 2.5), max(3.0, 0.75 * len(ns) + 2.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for x, m in enumerate(ms):
        for y, n in enumerate(ns):
            r = cells.get((m, n))
            if r is None:  # not predicted (the search stopped raising N): blank
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor="white", edgecolor="#dddddd"))
                ax.text(x, y, "-", ha="center", va="center", fontsize=8, color="#999999")
                continue
            if not r.feasible:
                ax.add_patch(
                    Rectangle(
                        (x - 0.5, y - 0.5), 1, 1, facecolor="#bdbdbd", edgecolor="#777777", hatch="xx", linewidth=0.5
                    )
                )
                ax.text(
                    x,
                    y,
                    _label(r, advance),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black",
                    bbox={"facecolor": "#bdbdbd", "edgecolor": "none", "pad": 1},
                )
                continue
            v = (min(r.samples_per_sec, hi) - lo) / (hi - lo)
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=cmap(v), edgecolor="white", linewidth=0.5))
            ax.text(
                x, y, _label(r, advance), ha="center", va="center", fontsize=7, color="black" if v > 0.6 else "white"
            )
    if table.choice is not None and (table.choice.num_microbatches, table.choice.num_pipelines) in cells:
        x = ms.index(table.choice.num_microbatches)
        y = ns.index(table.choice.num_pipelines)
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=3, zorder=5))
    ax.set_xlim(-0.5, len(ms) - 0.5)
    ax.set_ylim(-0.5, len(ns) - 0.5)
    ax.set_xticks(range(len(ms)))
    ax.set_xticklabels([str(m) for m in ms])
    ax.set_yticks(range(len(ns)))
    ax.set_yticklabels([str(n) for n in ns])
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("pipelines N")
    ax.set_title(_title(table), fontsize=9)
    mappable = ScalarMappable(cmap=cmap, norm=Normalize(lo, hi))
    fig.colorbar(mappable, ax=ax, label="samples/s (feasible settings)")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=120, format="png")
    os.replace(tmp, path)
    return path


def write_report(table: TuningTable, directory: str | Path, stem: str = "tuning") -> dict[str, Path]:
    """Write ``<stem>.json`` (every prediction, the choice, the profile) and ``<stem>.png`` (the heat map).

    Returns the paths written: ``{"json": ..., "png": ...}``, without ``"png"`` when matplotlib is missing.
    """
    directory = Path(directory)
    out: dict[str, Path] = {"json": table.write_json(directory / f"{stem}.json")}
    png = write_heatmap(table, directory / f"{stem}.png")
    if png is not None:
        out["png"] = png
    return out
