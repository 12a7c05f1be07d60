"""What sharding a stage over its D ranks costs per rank: the bytes it holds and the collectives it runs
(docs/parallelism.md#sharded-stages, ``runtime/sharding/fsdp.py``). Plain numbers in, plain numbers out.

Per stage, W = its weights' bytes, O = its optimizer state's (2W under Adam), L = its largest layer's weights, one
model (``averaging="exact"``) over D > 1 groups, U = N x M units a step:

==============================  ====================  ===================================  ===========================
level (reduce)                  between steps         within a step, besides activations   collectives over D a step
==============================  ====================  ===================================  ===========================
NO_SHARD                        W + W + O             the same                             all-reduce of the grads
SHARD_OPTIM (ZeRO-1)            W + W + O/D           the same                             + all-gather of the slices
SHARD_GRAD_OP, per_microbatch   (W + W + O)/D         + W gathered + L (a layer's grads)   1 all-gather, U red.-scatters
FULL_SHARD, per_microbatch      (W + W + O)/D         + L gathered + L (a layer's grads)   2U all-gathers, U r.-scatters
either, per_step                (W + W + O)/D         + W gathered + W whole grads         1 all-gather, 1 red.-scatter
==============================  ====================  ===================================  ===========================

The gathered copies come on top of the shards, which FSDP2 keeps. A schedule that defers the weight gradients
(``zbh1``, ``zbv``) accumulates them whole and reduces once, as ``per_step`` does; ``FULL_SHARD`` there still gathers
each layer for each use. An all-gather or a reduce-scatter of W moves (D-1)/D x W per rank: half an all-reduce
(``reference_allreduce_s``, the profile's all-reduce of the largest stage's weights). Per-unit collectives run inside
the units (the forward gathers, the backward gathers and reduce-scatters), where the schedule's simulator places
them; the per-step ones are waited for. With D = 1 every level is ``NO_SHARD``.
"""

from __future__ import annotations

from dataclasses import dataclass

# config.LEVELS and config.REDUCE (tests/test_tuning_sharding.py holds them together): config imports torch, which
# the schedule and whatif commands do not load
LEVELS = ("NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD")  # ZeRO-0 .. ZeRO-3
REDUCE = ("per_microbatch", "per_step")
FSDP = ("SHARD_GRAD_OP", "FULL_SHARD")


def check(level: str, reduce: str) -> tuple[str, str]:
    """``(level, reduce)`` validated: a level by FSDP's names or ``zero0``..``zero3``, a reduce of ``REDUCE``."""
    if reduce not in REDUCE:
        raise ValueError(f"reduce_gradients={reduce!r} is not one of {list(REDUCE)}.")
    key = str(level).strip()
    zero = key.lower().replace("-", "").replace("_", "")
    if key.upper() in LEVELS:
        return key.upper(), reduce
    if zero in ("zero0", "zero1", "zero2", "zero3"):
        return LEVELS[int(zero[-1])], reduce
    raise ValueError(f"sharding={level!r} is not one of {list(LEVELS)} (or 'zero0'..'zero3').")


@dataclass(frozen=True)
class Sharded:
    """How one stage is held over its D ranks: ``level``, ``reduce`` and whether the schedule ``splits`` the
    backward (which reduces once per step whatever ``reduce`` says)."""

    level: str = "NO_SHARD"
    reduce: str = "per_microbatch"
    splits: bool = False

    @property
    def fsdp(self) -> bool:
        return self.level in FSDP

    @property
    def whole_grads(self) -> bool:
        """Gradients accumulated whole through the step and reduced once at its end."""
        return self.reduce == "per_step" or self.splits

    @property
    def gathers_each_use(self) -> bool:
        """Weights gathered for each forward and backward and freed after (``FULL_SHARD`` per micro-batch)."""
        return self.level == "FULL_SHARD" and self.reduce != "per_step"

    def rest_bytes(self, w: float, o: float, d: int) -> float:
        """Weights, gradients and optimizer state a rank holds between steps."""
        if d <= 1 or self.level == "NO_SHARD":
            return 2 * w + o
        if self.level == "SHARD_OPTIM":
            return 2 * w + o / d
        return (2 * w + o) / d

    def step_bytes(self, w: float, o: float, layer: float, d: int) -> float:
        """What a rank holds within a step besides the activations: :meth:`rest_bytes` plus the gathered weights and
        the whole gradients (``layer``: the largest layer's weights; 0 if not known, then W)."""
        rest = self.rest_bytes(w, o, d)
        if d <= 1 or not self.fsdp:
            return rest
        layer = min(layer, w) if layer > 0 else w
        gathered = layer if self.gathers_each_use else w
        return rest + gathered + (w if self.whole_grads else layer)

    def per_unit(self, d: int) -> tuple[float, float]:
        """All-gathers and reduce-scatters of a stage's weights in (one unit's forward, its backward)."""
        if d <= 1 or not self.fsdp:
            return 0.0, 0.0
        gather = 1.0 if self.gathers_each_use else 0.0
        return gather, gather + (0.0 if self.whole_grads else 1.0)

    def per_step(self, d: int, exact: bool) -> float:
        """Collectives of a stage's weights a step waits for, in all-gathers (an all-reduce counts two): the
        gradients' all-reduce (``NO_SHARD``, exact), plus ZeRO-1's all-gather of the slices; under FSDP the one
        all-gather of a kept gathered copy and the one reduce-scatter of whole gradients."""
        if d <= 1 or not exact:
            return 0.0
        if not self.fsdp:
            return 2.0 + (1.0 if self.level == "SHARD_OPTIM" else 0.0)
        return (0.0 if self.gathers_each_use else 1.0) + (1.0 if self.whole_grads else 0.0)

    def collectives(self, units: int, d: int, exact: bool) -> float:
        """Every all-gather-sized collective of a stage's weights in a step of ``units`` units."""
        forward, backward = self.per_unit(d)
        return units * (forward + backward) + self.per_step(d, exact)


def levels_for(num_groups: int, exact: bool) -> list[str]:
    """The levels a layout can run, lightest first: every level with exact averaging over D > 1 groups, ZeRO-1 at
    most under elastic averaging (each group trains a replica of its own), none with D = 1."""
    if num_groups <= 1:
        return []
    return list(LEVELS) if exact else ["NO_SHARD", "SHARD_OPTIM"]


def wire_bytes(weights: float, num_groups: int) -> float:
    """Bytes one all-gather (or reduce-scatter) of ``weights`` moves per rank in a ring: (D-1)/D x weights."""
    return (num_groups - 1) / num_groups * weights if num_groups > 1 else 0.0
