"""Tensor parallelism's modes in the cost model (docs/parallelism.md#projecting-a-layout; issue 45, part 5).

What one of the T ranks that split a stage holds and moves, per mode, from what a profile knows of the stage: its
weights W, one unit's saved activations, its boundary activation A (what a stage sends) and its split layer pairs P
(the whole model's ``allreduces`` / S). f is the share of W that the plan splits.

======== ============== =================================== ===================================================
mode     weights        activations                         traffic per unit (forward; backward)
======== ============== =================================== ===================================================
1d       (1 - f + f/T)  (1 - f + f/T)                       P all-reduces of A over T; the same
1d + sp  (1 - f + f/T)  1/T                                 P (reduce-scatter + all-gather) of A and one
                                                            all-gather per attention; MLPs gather again
2d       (1 - f + f/q²) 1/q²                                SUMMA: q broadcasts of an activation block and of
                                                            a weight block per Linear, twice that backward
2.5d     (1 - f + f/q²) α/h + (1 - α)/(d q²)                as 2d on blocks 1/d the size, plus per step an
                                                            all-reduce of the SUMMA weights' gradients over d
======== ============== =================================== ===================================================

A transformer is assumed, as the grid's conversion (``runtime/sharding/grid_stage.py``) is: P / 2 blocks, each an
attention and an MLP of widening r (``WIDENING``), so an attention holds 4 / (4 + 2r) of the split weights and the MLP
the rest. On the grid (T = d q²) the MLP's two Linears run SUMMA: a Linear reading X broadcasts q blocks of X /
(d q²) along the grid row and q blocks of its weights / q² along the column, forward, and twice that backward; the
attention gets its input gathered from all T ranks (again in the backward, and its output's gradient), runs split by
heads over h ranks (an all-reduce of A each way) and keeps 1/h of its activations (α: their share, ``attention``),
h = T where T divides its heads (``heads``, as the grid splits them), else q²;
two LayerNorms per block all-reduce two statistics along the row each way (their latency is counted, not their
bytes: one value a token, 1/h of an activation). A stage's input is cut into blocks and its output gathered whole
(under sequence parallelism alike): one all-gather of A each way. Collectives are rings: an all-reduce moves
2 (n - 1)/n of its bytes in 2 (n - 1) steps, an all-gather or reduce-scatter half that; a broadcast step moves its
block once. Compute splits alike in every mode (2.5d repeating its attention on each depth layer is not counted).
Lightning-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("1d", "2d", "2.5d")
WIDENING = 4.0  # an MLP's hidden width over the model's (GPT's 4)


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank moves and the messages (latency steps) they take."""

    nbytes: float = 0.0
    messages: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.nbytes + other.nbytes, self.messages + other.messages)

    def __mul__(self, k: float) -> Traffic:
        return Traffic(self.nbytes * k, self.messages * k)

    __rmul__ = __mul__

    def seconds(self, latency_s: float, bandwidth: float) -> float:
        wire = self.nbytes / bandwidth if math.isfinite(bandwidth) else 0.0
        return wire + self.messages * latency_s


def all_reduce(nbytes: float, ranks: int) -> Traffic:
    return Traffic(2 * (ranks - 1) / ranks * nbytes, 2 * (ranks - 1)) if ranks > 1 else Traffic()


def all_gather(nbytes: float, ranks: int) -> Traffic:
    """An all-gather of a whole ``nbytes`` (or a reduce-scatter of it): half an all-reduce."""
    return Traffic((ranks - 1) / ranks * nbytes, ranks - 1) if ranks > 1 else Traffic()


def layouts(size: int) -> list[tuple[str, int, int]]:
    """Every ``(mode, d, q)`` that lays out ``size`` ranks as the strategy's check does (``config._check_grid``):
    ``("1d", 1, 0)``, ``("2d", 1, q)`` where size = q x q with q >= 2, ``("2.5d", d, q)`` where size = d q² with
    d, q >= 2."""
    found = [("1d", 1, 0)]
    for d in range(1, size + 1):
        q = math.isqrt(size // d) if size % d == 0 else 0
        if q >= 2 and d * q * q == size:
            found.append(("2d" if d == 1 else "2.5d", d, q))
    return found


def grid_sizes(depth: int, limit: int) -> list[int]:
    """The tensor_parallel_size values d q² (q >= 2) up to ``limit`` (at least two)."""
    sizes = [depth * q * q for q in range(2, 64) if depth * q * q <= limit]
    return sizes if len(sizes) >= 2 else [depth * 4, depth * 9]


def check_mode(size: int, mode: str, depth: int, sequence_parallel: bool) -> int:
    """q of ``mode`` on ``size`` ranks (0 under ``"1d"``); a ValueError naming the value and the fix otherwise."""
    if mode not in MODES:
        raise ValueError(
            f"tensor_parallel_mode={mode!r} is not one of {list(MODES)}: '1d' splits weights over T, '2d' weights and "
            "activations over a q x q grid, '2.5d' over d copies of it."
        )
    if not isinstance(depth, int) or depth < 1 or (mode == "2.5d") != (depth > 1):
        raise ValueError(
            f"tensor_parallel_depth={depth!r} with tensor_parallel_mode={mode!r}: the depth d is >= 2 under '2.5d' "
            "and 1 otherwise; give tensor_parallel_mode='2.5d' with a depth of 2 or more, or leave the depth out."
        )
    if sequence_parallel and (mode != "1d" or size == 1):
        raise ValueError(
            f"sequence_parallel=True with tensor_parallel_mode={mode!r} and tensor_parallel_size={size}: it cuts the "
            "sequence under '1d' with T > 1 (the grid cuts it already); leave it out, or use '1d' with T > 1."
        )
    if mode == "1d":
        return 0
    q = next((q for m, d, q in layouts(size) if m == mode and d == depth), 0)
    if not q:
        fits = [f"{m} d={d}" if d > 1 else m for m, d, _ in layouts(size)]
        raise ValueError(
            f"tensor_parallel_mode={mode!r} with tensor_parallel_depth={depth} needs T = "
            f"{'d x ' if depth > 1 else ''}q x q ranks with q >= 2, but tensor_parallel_size={size}: use one of "
            f"{grid_sizes(depth, max(size * 2, 36))} ranks, or at T={size} a mode that fits: {', '.join(fits)}."
        )
    return q


@dataclass(frozen=True)
class Mode:
    """One layout of T = ``size`` ranks (see the module docstring): its per-rank shares and traffic."""

    size: int
    mode: str = "1d"
    depth: int = 1
    sequence_parallel: bool = False
    fraction: float = 1.0  # f: the share of the weights the plan splits
    attention: float = 0.5  # α: the attention's share of a stage's saved activations (2.5d keeps it at 1/h)
    heads: int = 0  # the attention's heads (0: not known): T splits them where it divides them, else q² does

    @property
    def q(self) -> int:
        return check_mode(self.size, self.mode, self.depth, self.sequence_parallel)

    @property
    def label(self) -> str:
        if self.mode == "1d":
            return "1d+sp" if self.sequence_parallel else "1d"
        return f"2d q={self.q}" if self.mode == "2d" else f"2.5d d={self.depth} q={self.q}"

    def weights(self) -> float:
        """The share of a stage's weights (and optimizer state) one rank keeps."""
        split = self.size if self.mode == "1d" else self.q**2
        return 1.0 - self.fraction + self.fraction / split

    def activations(self) -> float:
        """The share of one unit's saved activations one rank keeps."""
        if self.mode == "1d":
            return 1.0 / self.size if self.sequence_parallel else 1.0 - self.fraction + self.fraction / self.size
        return self.attention / self.attention_ranks + (1.0 - self.attention) / (self.depth * self.q**2)

    @property
    def attention_ranks(self) -> int:
        """h: the grid's ranks that split an attention by heads (all T where T divides ``heads``, else q²)."""
        return self.size if self.heads and self.heads % self.size == 0 else self.q**2

    def boundary(self) -> float:
        """The share of a boundary-sized activation a rank holds between layers (a checkpointed layer's input)."""
        return 1.0 if self.mode == "1d" and not self.sequence_parallel else 1.0 / self.size

    def traffic(self, boundary: float, weights: float, pairs: float) -> tuple[Traffic, Traffic]:
        """One unit's (forward, backward) traffic per rank on a stage of ``weights`` bytes with ``pairs`` split pairs,
        ``boundary`` the bytes of one boundary activation A."""
        T, A = self.size, boundary
        if T == 1:
            return Traffic(), Traffic()
        if self.mode == "1d" and not self.sequence_parallel:
            return pairs * all_reduce(A, T), pairs * all_reduce(A, T)
        blocks = pairs / 2
        edge = all_gather(A, T)  # the stage's output gathered whole; in the backward, its input's gradient
        if self.mode == "1d":  # an MLP: gather + scatter, and backward its gather again; an attention: gather + 1D
            mlp_f, mlp_b = 2 * all_gather(A, T), 3 * all_gather(A, T)
            attn = all_gather(A, T) + all_reduce(A, T)
            return blocks * (mlp_f + attn) + edge, blocks * (mlp_b + attn) + edge
        q, d = self.q, self.depth
        # the MLPs' two Linears read A and r A; each of q steps broadcasts an activation block and a weight block
        summa = blocks * Traffic((1 + WIDENING) * A / (d * q), 4 * q) + Traffic(self._summa_weights(weights) / q)
        attn_f = all_gather(A, T) + all_reduce(A, self.attention_ranks)
        attn_b = 2 * all_gather(A, T) + all_reduce(A, self.attention_ranks)
        norms = 4 * all_reduce(0.0, q)  # two LayerNorms, two statistics each
        return summa + blocks * (attn_f + norms) + edge, 2 * summa + blocks * (attn_b + norms) + edge

    def _summa_weights(self, weights: float) -> float:
        """The bytes of a stage's weights that SUMMA cuts: the MLPs' share of the split ones."""
        return self.fraction * weights * 2 * WIDENING / (4 + 2 * WIDENING)

    def step_traffic(self, weights: float) -> Traffic:
        """Per optimizer step: under 2.5d the SUMMA weights' gradients (their q² block) summed over the d copies."""
        if self.mode != "2.5d":
            return Traffic()
        return all_reduce(self._summa_weights(weights) / self.q**2, self.depth)


@dataclass(frozen=True)
class Row:
    """One mode of :func:`compare`: per rank and stage, bytes, and one unit's traffic (forward + backward)."""

    label: str
    weights: float
    activations: float
    unit: Traffic
    unit_s: float
    step: Traffic


def compare(
    size: int,
    weights: float,
    activations: float,
    boundary: float,
    pairs: float,
    latency_s: float,
    bandwidth: float,
    fraction: float = 1.0,
    attention: float = 0.5,
    heads: int = 0,
) -> list[Row]:
    """Every layout of ``size`` ranks (1d, 1d+sp, 2d, 2.5d per :func:`layouts`) on one stage: ``weights`` (its
    bytes), ``activations`` (one unit's saved bytes) and ``boundary`` (A) whole, ``pairs`` its split pairs."""
    kinds = (
        [("1d", 1, False)] + ([("1d", 1, True)] if size > 1 else []) + [(m, d, False) for m, d, _ in layouts(size)[1:]]
    )
    modes = [Mode(size, m, d, sp, fraction, attention, heads) for m, d, sp in kinds]
    rows = []
    for m in modes:
        f, b = m.traffic(boundary, weights, pairs)
        rows.append(
            Row(
                m.label,
                weights * m.weights(),
                activations * m.activations(),
                f + b,
                (f + b).seconds(latency_s, bandwidth),
                m.step_traffic(weights),
            )
        )
    return rows


def format_rows(rows: list[Row], size: int, b: float) -> str:
    """``whatif``'s table of :func:`compare`'s rows."""
    mib = 2.0**20
    lines = [
        f"tensor modes at T={size}, per rank and stage (micro-batch size {b:g}; traffic: a unit's forward + backward):",
        f"  {'mode':<14} {'weights MiB':>12} {'activations MiB':>16} {'traffic MiB':>12} {'traffic ms':>11}",
    ]
    for r in rows:
        step = f"  + {r.step.nbytes / mib:.3f} MiB per step over d" if r.step.nbytes else ""
        lines.append(
            f"  {r.label:<14} {r.weights / mib:>12.3f} {r.activations / mib:>16.3f} {r.unit.nbytes / mib:>12.3f} "
            f"{r.unit_s * 1e3:>11.3f}{step}"
        )
    if not any(r.label.startswith("2") for r in rows):
        lines.append(f"  no 2D layout: T={size} is not d x q x q with q >= 2 (2d: 4, 9, 16 ranks; 2.5d: 8, 18, 32)")
    return "\n".join(lines)
