"""Choosing the advance-forward count k online (DESIGN.md §1.2): raise k while iterations get faster and fit.

Start at k = 0 (1F1B). Measure a few iterations at each k (the first after a change is dropped: its plan and
buffers are new). Move to k + 1 while the median step time improved on the previous k's by more than the noise
margin and every stage's peak memory, plus the one more unit of activations that k + 1 stashes, stays under the
limit. Otherwise settle on the best k seen. Plain numbers in, a decision out: the strategy measures, broadcasts and
applies it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class AdvanceSearch:
    """The state of the search over k.

    Args:
        max_k: the largest useful k (units - 1: beyond it the plan is AFAB).
        memory_limit: bytes a stage may hold at its peak; ``None`` for no limit.
        steps_per_k: iterations measured at each k (after one dropped warm-up iteration).
        noise: relative improvement a larger k must bring to count as faster.
    """

    max_k: int
    memory_limit: float | None = None
    steps_per_k: int = 3
    noise: float = 0.03
    k: int = 0
    settled: bool = False
    reason: str = ""
    _times: dict[int, list[float]] = field(default_factory=dict)
    _seen_at_k: int = 0

    def observe(self, step_time: float, peak_bytes: Sequence[float], unit_bytes: Sequence[float]) -> int:
        """Record one iteration at the current k; returns the k to use next."""
        if self.settled:
            return self.k
        self._seen_at_k += 1
        if self._seen_at_k == 1:
            return self.k  # warm-up after a change of plan
        times = self._times.setdefault(self.k, [])
        times.append(step_time)
        if len(times) < self.steps_per_k:
            return self.k
        current = statistics.median(times)
        previous = statistics.median(self._times[self.k - 1]) if self.k > 0 else None
        if previous is not None and not current < previous * (1 - self.noise):
            self._settle(self.k - 1, f"k={self.k} took {current * 1e3:.1f} ms vs {previous * 1e3:.1f} ms at "
                                     f"k={self.k - 1}: not faster by more than {self.noise:.0%}")
            return self.k
        if self.k >= self.max_k:
            self._settle(self.k, f"k={self.k} is the largest useful value (the plan is AFAB beyond it)")
            return self.k
        if self.memory_limit is not None:
            worst = max(p + u for p, u in zip(peak_bytes, unit_bytes))
            if worst > self.memory_limit:
                self._settle(self.k, f"k={self.k + 1} would need about {worst / 2**20:.1f} MiB on a stage, over the "
                                     f"limit of {self.memory_limit / 2**20:.1f} MiB")
                return self.k
        self.k += 1
        self._seen_at_k = 0
        return self.k

    def _settle(self, k: int, why: str) -> None:
        self.k, self.settled = k, True
        best = statistics.median(self._times[k]) if self._times.get(k) else float("nan")
        self.reason = f"settled on advance_forwards={k} ({best * 1e3:.1f} ms per iteration): {why}"
