"""Reporting a tuning table: the JSON of every prediction and a heat map of the objective over (M, N).
(Design: docs/how-it-works.md#choosing-m-and-n.)

The heat map has one panel per schedule predicted, the candidate micro-batch counts M across and the pipeline counts N
down; each cell holds the predicted value of the objective, goodput or samples/s, of that schedule's best averaging at
that (M, N) (which one is written under it when there are two), and the early forwards k under ``advance``. Settings
that do not fit the memory limit are grey, hatched and labelled ``OOM``; settings the search did not predict (it stops
raising N once no M fits) are left blank; the chosen cell is outlined red, the best predicted dashed orange (they
differ where a tie kept your setting). matplotlib is optional: without it no PNG is written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from lightning_avgpipe.tuning.model import Prediction
from lightning_avgpipe.tuning.search import TuningTable


def _title(table: TuningTable) -> str:
    limit = "none" if table.memory_limit is None else f"{table.memory_limit / 2**20:.1f} MiB"
    what = "goodput (samples/s x efficiency)" if table.objective == "goodput" else "samples/s"
    title = f"predicted {what}, memory limit={limit}"
    if table.profile is not None:
        title += f"\nS={table.profile.num_stages}, D={table.profile.num_groups}, B={table.profile.batch_size}"
    if table.choice is not None:
        c = table.choice
        title += f"; chosen {c.schedule}, M={c.num_microbatches}, N={c.num_pipelines}"
        if table.objective == "goodput" and c.num_pipelines > 1:
            title += f" ({c.averaging})"
        if c.schedule == "advance":
            title += f", k={c.advance_forwards}"
    return title


def _key(r: Prediction) -> tuple[int, int]:
    return (r.num_microbatches, r.num_pipelines)


def _label(r: Prediction, advance: bool, value_of: Callable[[Prediction], float], averaging: bool) -> str:
    if not r.feasible:
        return f"OOM\n{max(r.peak_bytes) / 2**20:.0f} MiB"
    v = value_of(r)
    value = "inf" if not math.isfinite(v) else f"{v:.1f}" if v < 1000 else f"{v:.0f}"
    if averaging and r.num_pipelines > 1:
        value += f"\n{r.averaging}"
    return f"{value}\nk={r.advance_forwards}" if advance else value


def cells(table: TuningTable, schedule: str | None = None) -> dict[tuple[int, int], Prediction]:
    """(M, N) -> the row the heat map shows: the feasible one with the best objective (else the first), among
    ``schedule``'s rows (all rows: ``None``)."""
    out: dict[tuple[int, int], Prediction] = {}
    for r in table.rows:
        if schedule is not None and r.schedule != schedule:
            continue
        key = (r.num_microbatches, r.num_pipelines)
        old = out.get(key)
        if old is None or (r.feasible and (not old.feasible or table.value(r) > table.value(old))):
            out[key] = r
    c = table.choice
    if c is not None and (schedule is None or c.schedule == schedule):  # the chosen row is the one its cell shows
        out[(c.num_microbatches, c.num_pipelines)] = c
    return out


def panels(table: TuningTable) -> list[tuple[str, dict[tuple[int, int], Prediction]]]:
    """One panel per schedule the table predicts (the configured one first): its cells (:func:`cells`)."""
    names = sorted({r.schedule for r in table.rows}, key=lambda name: (name != table.schedule, name))
    return [(name, cells(table, name)) for name in names]


def best_row(table: TuningTable) -> Prediction | None:
    """The feasible row with the best objective (the chosen one may differ: a tie kept your setting)."""
    feasible = [r for r in table.rows if r.feasible and math.isfinite(table.value(r))]
    return max(feasible, key=table.value) if feasible else None


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
    value_of = table.value
    two = len({r.averaging for r in table.rows}) > 1
    shown_panels = panels(table)
    good = [
        value_of(r) for _, shown in shown_panels for r in shown.values() if r.feasible and math.isfinite(value_of(r))
    ]
    lo, hi = (min(good), max(good)) if good else (0.0, 1.0)
    if hi <= lo:
        hi = lo + 1.0
    cmap = matplotlib.colormaps["viridis"]
    best = best_row(table)

    width = max(5.0, 1.1 * len(ms) + 2.5)
    size = (width * len(shown_panels) - 1.5 * (len(shown_panels) - 1), max(3.0, 0.75 * len(ns) + 2.4))
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(shown_panels), squeeze=False)[0]
    for ax, (schedule, shown) in zip(axes, shown_panels):
        advance = schedule == "advance"
        for x, m in enumerate(ms):
            for y, n in enumerate(ns):
                r = shown.get((m, n))
                if r is None:  # not predicted (the search stopped raising N): blank
                    ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor="white", edgecolor="#dddddd"))
                    ax.text(x, y, "-", ha="center", va="center", fontsize=8, color="#999999")
                    continue
                if not r.feasible:
                    ax.add_patch(
                        Rectangle(
                            (x - 0.5, y - 0.5),
                            1,
                            1,
                            facecolor="#bdbdbd",
                            edgecolor="#777777",
                            hatch="xx",
                            linewidth=0.5,
                        )
                    )
                    ax.text(
                        x,
                        y,
                        _label(r, advance, value_of, two),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="black",
                        bbox={"facecolor": "#bdbdbd", "edgecolor": "none", "pad": 1},
                    )
                    continue
                v = (min(value_of(r), hi) - lo) / (hi - lo)
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=cmap(v), edgecolor="white", linewidth=0.5))
                ax.text(
                    x,
                    y,
                    _label(r, advance, value_of, two),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if v > 0.6 else "white",
                )
        for row, colour, style in ((best, "orange", "--"), (table.choice, "red", "-")):
            if row is not None and row.schedule == schedule and shown.get(_key(row)) is row:
                x, y = ms.index(row.num_microbatches), ns.index(row.num_pipelines)
                ax.add_patch(
                    Rectangle(
                        (x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor=colour, linewidth=3, linestyle=style, zorder=5
                    )
                )
        ax.set_xlim(-0.5, len(ms) - 0.5)
        ax.set_ylim(-0.5, len(ns) - 0.5)
        ax.set_xticks(range(len(ms)))
        ax.set_xticklabels([str(m) for m in ms])
        ax.set_yticks(range(len(ns)))
        ax.set_yticklabels([str(n) for n in ns])
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("pipelines N")
        ax.set_title(f"schedule={schedule}", fontsize=9)
    fig.suptitle(_title(table) + "\nred: chosen; dashed orange: the best predicted", fontsize=9)
    mappable = ScalarMappable(cmap=cmap, norm=Normalize(lo, hi))
    what = "goodput" if table.objective == "goodput" else "samples/s"
    fig.colorbar(mappable, ax=list(axes), label=f"{what} (feasible settings)")
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
