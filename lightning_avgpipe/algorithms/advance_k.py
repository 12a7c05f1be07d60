"""Choosing the advance-forward count k online (``advance_forwards="auto"``): raise k while iterations get faster and
fit, looking past flat steps, then keep the best k measured.

k early forwards run on every stage but the last (the last stage keeps 1F1B's order: there an early forward fills
no bubble and only stashes activations), so k + 1 stashes one more unit on stage s < S - 1 until it holds all of
them, and nothing more on the last stage (``lightning_avgpipe.schedules.peak_stash``).

Start at k = 0 (1F1B). Measure a few iterations at each k (the first after a change is dropped: its plan and
buffers are new) and take their median. A k *improves* when its median beats the reference (the median of the last
k that improved, at first k = 0's) by more than the noise margin. Keep raising k by one while

- fewer than ``patience`` k's in a row failed to improve: the step-time curve over k can have flat steps (an early
  forward that lands where no stage waited changes nothing, and the gain shows only at a later k), so one k that is
  no faster does not end the search; a k that is slower only counts as one that failed, since on a shared machine
  one median can be slow by chance;
- k < ``max_k`` (from ``max_advance_forwards(S, units)`` on, stages 0 .. S - 2 run AFAB's order and no larger k
  changes the plan);
- every stage's peak memory plus what k + 1 adds to it (``added_bytes``: one more unit of activations on the
  stages whose stash grows) stays under the limit.

Then settle on the best k measured: the smallest k whose median is within the noise margin of the fastest median
(a smaller k stashes fewer units, so it is the one to keep when the times cannot be told apart). Plain numbers in, a
decision out: the strategy measures, decides on global rank 0, broadcasts and applies it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_avgpipe.schedules import peak_stash


def added_bytes(activation_bytes: Sequence[float], num_stages: int, units: int, k: int) -> list[float]:
    """Per stage, the activation bytes ``advance_forwards=k + 1`` adds to the peak measured at ``k``.

    ``activation_bytes``: each stage's measured activation peak at ``k``, ``peak_stash("advance", S, units, k)``
    units' worth. A stage whose stash grows at ``k + 1`` (``s < S - 1`` still holding fewer than ``units``) adds one
    unit's bytes (its peak / its stash); the others, the last stage among them, add nothing.
    """
    if len(activation_bytes) != num_stages:
        raise ValueError(f"activation_bytes has {len(activation_bytes)} entries for {num_stages} stages.")
    now = peak_stash("advance", num_stages, units, k)
    then = peak_stash("advance", num_stages, units, k + 1)
    return [float(a) / max(1, n) * (t - n) for a, n, t in zip(activation_bytes, now, then, strict=True)]


@dataclass
class AdvanceSearch:
    """The state of the search over k.

    Args:
        max_k: the largest useful k (``max_advance_forwards(S, units)``: no larger k changes the plan).
        memory_limit: bytes a stage may hold at its peak; ``None`` for no limit.
        steps_per_k: iterations measured at each k (after one dropped warm-up iteration).
        noise: relative margin: a k improves when its median is lower than the reference's by more than this, and
            the settled k is the smallest whose median is within it of the fastest.
        patience: how many k's in a row may fail to improve before the search stops (1: stop at the first k that
            is no faster, the greedy rule; 2, the default, looks past one flat step).
    """

    max_k: int
    memory_limit: float | None = None
    steps_per_k: int = 3
    noise: float = 0.03
    patience: int = 2
    k: int = 0
    settled: bool = False
    reason: str = ""
    _times: dict[int, list[float]] = field(default_factory=dict)
    _seen_at_k: int = 0
    _ref_k: int = 0  # the last k that improved (k = 0 at first)
    _misses: int = 0  # k's in a row, since _ref_k, that did not improve on it

    def __post_init__(self) -> None:
        if self.max_k < 0 or self.steps_per_k < 1 or self.patience < 1 or self.noise < 0:
            raise ValueError(
                f"AdvanceSearch needs max_k >= 0, steps_per_k >= 1, patience >= 1 and noise >= 0; got "
                f"max_k={self.max_k}, steps_per_k={self.steps_per_k}, patience={self.patience}, "
                f"noise={self.noise}"
            )

    def medians(self) -> dict[int, float]:
        """The median step time of every k measured so far (all ``steps_per_k`` iterations in)."""
        return {k: statistics.median(t) for k, t in sorted(self._times.items()) if len(t) >= self.steps_per_k}

    def observe(self, step_time: float, peak_bytes: Sequence[float], added: Sequence[float]) -> int:
        """Record one iteration at the current k; returns the k to use next.

        ``peak_bytes``: each stage's peak at k; ``added``: the bytes k + 1 would add to it on each stage
        (``added_bytes``: one unit's activations where the stash grows, 0 on the last stage).
        """
        if self.settled:
            return self.k
        self._seen_at_k += 1
        if self._seen_at_k == 1:
            return self.k  # warm-up after a change of plan
        times = self._times.setdefault(self.k, [])
        times.append(step_time)
        if len(times) < self.steps_per_k:
            return self.k
        k, current = self.k, statistics.median(times)
        if k > 0:
            ref = statistics.median(self._times[self._ref_k])
            if current < ref * (1 - self.noise):
                self._ref_k, self._misses = k, 0
            else:
                self._misses += 1
                if self._misses >= self.patience:
                    tried = f"k={k - self._misses + 1}..{k}" if self._misses > 1 else f"k={k}"
                    self._settle(
                        f"{tried} not faster than {ref * 1e3:.1f} ms at k={self._ref_k} by more than "
                        f"{self.noise:.0%} ({self._misses} in a row, patience {self.patience})"
                    )
                    return self.k
        if k >= self.max_k:
            self._settle(f"k={k} is the largest useful value (no larger k changes the plan)")
            return self.k
        if self.memory_limit is not None:
            worst = max((p + a for p, a in zip(peak_bytes, added)), default=0.0)
            if worst > self.memory_limit:
                self._settle(
                    f"k={k + 1} would need about {worst / 2**20:.1f} MiB on a stage, over the limit of "
                    f"{self.memory_limit / 2**20:.1f} MiB"
                )
                return self.k
        self.k += 1
        self._seen_at_k = 0
        return self.k

    def _settle(self, why: str) -> None:
        """Stop the search: keep the smallest measured k within the noise margin of the fastest median."""
        medians = self.medians()
        fastest = min(medians.values())
        chosen = min(k for k, t in medians.items() if t <= fastest * (1 + self.noise))
        fast_k = min(medians, key=medians.__getitem__)
        self.k, self.settled = chosen, True
        best = (
            "the fastest measured"
            if chosen == fast_k
            else f"within {self.noise:.0%} of the fastest, k={fast_k} at {fastest * 1e3:.1f} ms"
        )
        table = " ".join(f"k{k}:{t * 1e3:.1f}" for k, t in medians.items())
        self.reason = (
            f"settled on advance_forwards={chosen} ({medians[chosen] * 1e3:.1f} ms per iteration, {best}); "
            f"stopped at k={max(medians)}: {why}; median ms by k: {table}"
        )
