"""A pure solver for contiguous block partitioning: split a sequence of costs into k blocks minimising the largest.

This is the linear partition problem (see Skiena, "The Algorithm Design Manual", §8.5; torchgpipe balances with a
faster approximate solver from Bokhari, "Partitioning problems in parallel, pipelined, and distributed computing",
1988). Layer counts are small (hundreds), so we solve it exactly with dynamic programming in O(k·n²).
"""

from __future__ import annotations

from collections.abc import Sequence


def solve(costs: Sequence[float], blocks: int) -> list[int]:
    """Sizes of ``blocks`` contiguous, non-empty blocks of ``costs`` whose largest block sum is minimal.

    Among optimal answers the one found first scanning split points from the left is returned, so the result
    is deterministic for equal inputs (all ranks compute the same partition).

    >>> solve([1, 1, 1, 1], 2)
    [2, 2]
    >>> solve([4, 1, 1, 1, 1], 2)
    [1, 4]
    """
    n = len(costs)
    if blocks < 1:
        raise ValueError(f"blocks={blocks} must be >= 1.")
    if n < blocks:
        raise ValueError(
            f"Cannot split {n} layers into {blocks} non-empty stages; use at most {n} stages or expose more layers "
            "in configure_pipeline()."
        )
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be non-negative, got {list(costs)}.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal largest block sum splitting the first i costs into k blocks; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(blocks + 1)]
    cut = [[0] * (n + 1) for _ in range(blocks + 1)]
    best[0][0] = 0.0
    for k in range(1, blocks + 1):
        for i in range(k, n - (blocks - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i] = value
                    cut[k][i] = j
    sizes = []
    i = n
    for k in range(blocks, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def uniform(n: int, blocks: int) -> list[int]:
    """Split ``n`` layers into ``blocks`` counts that differ by at most one (earlier stages get the extra)."""
    if n < blocks:
        raise ValueError(f"Cannot split {n} layers into {blocks} non-empty stages; use at most {n} stages.")
    base, extra = divmod(n, blocks)
    return [base + (1 if i < extra else 0) for i in range(blocks)]
