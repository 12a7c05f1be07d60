"""The gradient noise scale, and the statistical efficiency it predicts (docs/how-it-works.md, "Noise scale").

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", appendix A): with G the true gradient and
Σ the per-sample gradient covariance, a batch of b samples has ``E|G_b|² = |G|² + tr(Σ) / b``. Two batch sizes
b_small < b_big observed in the same step give unbiased estimates of both terms:

    |G|²  ≈ (b_big |G_big|² - b_small |G_small|²) / (b_big - b_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1 / b_small - 1 / b_big)

and the simple noise scale ``B_simple = tr(Σ) / |G|²``. One step's estimates are noisy (the |G|² one can be
negative), so each is smoothed with an exponential moving average and the ratio is taken of the averages, as the
paper does. A pipeline step already has both sizes: its parallel pipelines' gradients (b_small = B each) and their
mean (b_big = N·B), or, with one pipeline, the gradient of the first half of its micro-batches, of the second half
(b_small = B/2) and of all (b_big = B).

Under the same model, the progress per sample at batch b_eff relative to batch b is
``(B_noise + b) / (B_noise + b_eff)``: :func:`efficiency`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GradientNorms:
    """One step's squared gradient norms at two batch sizes (summed over stages and parameters).

    ``small_sq`` is the mean of the small batches' squared norms (each small batch's gradient is its own mean),
    ``small_batch`` their size (the harmonic mean when sizes differ); ``big_sq`` is the squared norm of the
    gradient of all of them together, of ``big_batch`` samples.
    """

    small_sq: float
    small_batch: float
    big_sq: float
    big_batch: float

    def estimates(self) -> tuple[float, float]:
        """``(|G|², tr Σ)``, each unbiased (either may come out negative on one step)."""
        bs, bb = float(self.small_batch), float(self.big_batch)
        if not bb > bs > 0:
            raise ValueError(f"need 0 < small_batch < big_batch, got small_batch={bs:g}, big_batch={bb:g}")
        grad_sq = (bb * self.big_sq - bs * self.small_sq) / (bb - bs)
        trace = (self.small_sq - self.big_sq) / (1.0 / bs - 1.0 / bb)
        return grad_sq, trace


class NoiseScale:
    """``B_simple`` smoothed over steps: EMAs of ``|G|²`` and ``tr Σ`` (bias-corrected), and their ratio.

    Args:
        decay: the EMA's weight on the past, per measurement, in [0, 1).
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not (isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0.0 <= decay < 1.0):
            raise ValueError(f"decay={decay!r}: must be a number in [0, 1); 0.9 smooths over about 10 measurements.")
        self.decay = float(decay)
        self._grad_sq = 0.0
        self._trace = 0.0
        self._weight = 0.0  # the EMA's bias correction: 1 - decay ** measurements
        self.measurements = 0

    def update(self, norms: GradientNorms) -> float | None:
        """Add one step's norms; return the smoothed noise scale (``None`` while it is not positive yet)."""
        grad_sq, trace = norms.estimates()
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return self.value
        d = self.decay
        self._grad_sq = d * self._grad_sq + (1 - d) * grad_sq
        self._trace = d * self._trace + (1 - d) * trace
        self._weight = d * self._weight + (1 - d)
        self.measurements += 1
        return self.value

    @property
    def grad_sq(self) -> float | None:
        """The smoothed ``|G|²`` (``None`` before the first measurement)."""
        return self._grad_sq / self._weight if self._weight > 0 else None

    @property
    def trace(self) -> float | None:
        """The smoothed ``tr Σ`` (``None`` before the first measurement)."""
        return self._trace / self._weight if self._weight > 0 else None

    @property
    def value(self) -> float | None:
        """``B_simple = tr Σ / |G|²`` of the smoothed terms; ``None`` until both are positive."""
        if self._weight <= 0 or self._grad_sq <= 0 or self._trace <= 0:
            return None
        return self._trace / self._grad_sq

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "grad_sq": self._grad_sq,
            "trace": self._trace,
            "weight": self._weight,
            "measurements": self.measurements,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = float(state["decay"])
        self._grad_sq = float(state["grad_sq"])
        self._trace = float(state["trace"])
        self._weight = float(state["weight"])
        self.measurements = int(state["measurements"])


# λ: elastic averaging of N replicas of batch B learns per sample like plain training at batch λ·N·B. Fitted on
# benchmarks/convergence.py (N = 4, lr tuned per method, 3 seeds, 2026-12-01): the samples to target of pipe-NB over
# pipe-B give each study's B_noise, and the paper's rule over pipe-NB its λ: 1.52 (digits MLP, Adam), 1.27 (char GPT,
# AdamW), 0.84 (digits CNN, SGD with momentum). λ = 1.2 ± 0.35 (docs/how-it-works.md#goodput).
ELASTIC_BATCH_FACTOR = 1.2
# The same fit for the variants of elastic averaging (the same runs):
# - averaging_period H = 4 (period-N): 2.96 (digits), 1.54 (text, the 1 seed of 3 that reached the target), 0.94 (CNN):
#   λ = 1.8 ± 0.9, measured at H = 4 only.
# - DiLoCo's outer Nesterov preset (outer_lr 0.7, outer_momentum 0.9) at H = 1 (outer-N) reached the target in no
#   study at any learning rate of its grid, extended three times: no finite λ fits. It is modelled as learning nothing
#   per sample (λ = inf, efficiency 0).
PERIOD_BATCH_FACTOR = 1.8
OUTER_BATCH_FACTOR = math.inf


def elastic_factor(period: int = 1, outer_lr: float = 1.0, outer_momentum: float = 0.0) -> tuple[float, str]:
    """λ for elastic averaging with these options, and what it rests on (a fit, or the nearest fitted rule)."""
    paper = outer_lr == 1.0 and outer_momentum == 0.0
    if paper and period == 1:
        return ELASTIC_BATCH_FACTOR, "the paper's rule, fitted (±0.35)"
    if paper:
        basis = "fitted at averaging_period=4 (±0.9)" if period == 4 else "not fitted at this period: H = 4's fit"
        return PERIOD_BATCH_FACTOR, basis
    if outer_momentum > 0.0 and period == 1:
        return OUTER_BATCH_FACTOR, "an outer momentum at H = 1 reached no target in the convergence benchmark"
    # not measured: the nearest fitted rule (the period's, else the paper's)
    near = PERIOD_BATCH_FACTOR if period > 1 else ELASTIC_BATCH_FACTOR
    return near, "not fitted for this outer optimizer: the nearest fitted rule's"


def effective_batch(
    averaging: str, num_pipelines: int, batch_size: float, num_groups: int = 1, factor: float = ELASTIC_BATCH_FACTOR
) -> float:
    """The plain-training batch a step of N pipelines x D groups of batch B learns like, per sample.

    ``"exact"`` is plain training at N·D·B. ``"elastic"`` learns like λ·N·D·B (λ = ``factor``: by default
    :data:`ELASTIC_BATCH_FACTOR`, the paper's rule; :func:`elastic_factor` for its variants, fitted on the convergence
    benchmark); with N·D = 1 it is plain training at B.
    """
    total = float(num_pipelines * num_groups * batch_size)
    if averaging == "exact" or num_pipelines * num_groups == 1:
        return total
    return factor * total


def efficiency(noise_scale: float | None, batch: float, effective_batch: float) -> float:
    """Progress per sample at ``effective_batch`` relative to ``batch``: ``(B_noise + B) / (B_noise + B_eff)``.

    ``None`` (no estimate) counts as an infinite noise scale, where every batch size is as efficient (1.0): the
    caller says so. A larger effective batch is never more efficient per sample.
    """
    if batch <= 0 or effective_batch <= 0:
        raise ValueError(f"batch sizes must be positive, got batch={batch:g}, effective_batch={effective_batch:g}")
    if math.isinf(effective_batch):  # a rule measured to reach no target (OUTER_BATCH_FACTOR)
        return 0.0
    if noise_scale is None or math.isinf(noise_scale):
        return 1.0
    noise_scale = max(float(noise_scale), 0.0)
    return (noise_scale + batch) / (noise_scale + effective_batch)
