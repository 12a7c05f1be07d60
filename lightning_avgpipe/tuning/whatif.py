"""What-if projection: a profile measured on one layout, rescaled to more stages, groups or tensor shards.
(Design: docs/how-it-works.md#choosing-m-and-n.)

Profiling needs the hardware; a layout that is larger than the machine at hand (more stages S', more data-parallel
groups D) can still be predicted by rescaling what was measured and running the same cost model and search.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_avgpipe.checks import is_int
from lightning_avgpipe.tuning.model import PipelineProfile, StageProfile, interpolate
from lightning_avgpipe.tuning.tensor_modes import Mode, check_mode


def _keys(dicts: Iterable[dict[float, float]]) -> list[float]:
    return sorted({k for d in dicts for k in d})


def _pooled(dicts: list[dict[float, float]], scale: float) -> dict[float, float]:
    """``scale`` x the sum over ``dicts`` at every size any of them measured (each interpolated at the others')."""
    return {b: scale * sum(interpolate(d, b) for d in dicts) for b in _keys(dicts)}


def allreduce_seconds(nbytes: float, ranks: int, latency_s: float, bandwidth: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``ranks``: 2(D-1)/D x bytes / bandwidth + 2(D-1) x latency (0 for D=1)."""
    if ranks <= 1:
        return 0.0
    wire = 2 * (ranks - 1) / ranks * nbytes / bandwidth if math.isfinite(bandwidth) else 0.0
    return wire + 2 * (ranks - 1) * latency_s


@dataclass(frozen=True)
class TensorParallel:
    """Tensor parallelism in a projection (docs/parallelism.md#projecting-a-layout).

    Attributes:
        size: T, the ranks that split every stage.
        fraction: the share of each stage's compute, weights and saved activations that the plan splits (1.0: all
            of it, the ideal; a transformer whose Linear layers are split is close to it, its norms and embeddings
            are not).
        allreduces: split layer pairs in the whole model; each all-reduces its output (one unit's boundary-sized
            activation) once forward and once backward over the T ranks.
        latency_s, bandwidth: the link between the T ranks of a node (None: the profiled link's).
        mode, depth, sequence_parallel: the strategy's ``tensor_parallel_mode``, ``tensor_parallel_depth`` and
            ``sequence_parallel`` (``tensor_modes.py``: what a rank holds and moves in each).
        attention: the attention's share of a stage's saved activations (2.5d keeps it at 1/h, the rest 1/(d q²)).
        heads: the attention's heads (0: not known); h = T where T divides them (the grid splits them so), else q².
    """

    size: int = 1
    fraction: float = 1.0
    allreduces: int = 0
    latency_s: float | None = None
    bandwidth: float | None = None
    mode: str = "1d"
    depth: int = 1
    sequence_parallel: bool = False
    attention: float = 0.5
    heads: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.size, 1):
            raise ValueError(f"tensor_parallel_size={self.size!r} must be an int >= 1 (1: no tensor parallelism).")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"tensor_fraction={self.fraction!r} must be in [0, 1]: the share of the work T splits.")
        if not is_int(self.allreduces, 0):
            raise ValueError(f"tensor_allreduces={self.allreduces!r} must be an int >= 0 (split layer pairs).")
        if not 0.0 <= self.attention <= 1.0:
            raise ValueError(f"attention_share={self.attention!r} must be in [0, 1]: the attention's activations.")
        if not is_int(self.heads, 0):
            raise ValueError(f"attention_heads={self.heads!r} must be an int >= 0 (0: not known).")
        check_mode(self.size, self.mode, self.depth, self.sequence_parallel)

    @property
    def layout(self) -> Mode:
        """The mode's shares and traffic (``tensor_modes.Mode``)."""
        return Mode(self.size, self.mode, self.depth, self.sequence_parallel, self.fraction, self.attention, self.heads)

    def shrink(self, value: float) -> float:
        """``value`` of one stage as one of its T ranks computes it (under 1d, also as it holds it)."""
        return value * (1.0 - self.fraction + self.fraction / self.size)


def project(
    profile: PipelineProfile,
    num_stages: int,
    num_groups: int = 1,
    latency_s: float | None = None,
    bandwidth: float | None = None,
    tensor: TensorParallel | None = None,
    checkpointed_layers: int | None = None,
) -> PipelineProfile:
    """The profile of the same model cut into ``num_stages`` stages S' and run in ``num_groups`` groups D.

    Assumptions (what the projection can and cannot know):

    * Balanced cut. The whole model's per-unit cost is pooled and split evenly: each new stage's forward and
      backward time at micro-batch size b is (sum over the profiled stages at b) / S'; so are the activation
      bytes a unit saves, the parameter bytes and the optimizer state bytes. Imbalance of the profiled
      partition (an embedding on stage 0, a head on the last) is averaged away, so projecting to the same S
      matches the original prediction only when its stages are identical; otherwise it is the balanced ideal.
      Compute is assumed to scale linearly with the layers a stage holds: kernel-launch and per-unit overheads
      are split too, which is optimistic for many small stages.
    * Sizes measured on some stages only are interpolated on the others (``model.interpolate``) before summing.
    * Sent bytes: the hidden size does not change with the cut, so every boundary sends the mean of the
      profiled boundaries' bytes (stages 0..S-2; a one-stage profile has no boundary and uses whatever its
      stage recorded, or nothing).
    * Optimizer step and elastic update times scale with the parameter share: each new stage gets
      (sum over profiled stages) x (its param bytes / all param bytes) = sum / S'.
    * Link: ``latency_s``/``bandwidth`` replace the profiled ones when given (for the pipeline's transfers and the
      all-reduce alike).
    * D groups: each stage's reference update is all-reduced over D ranks (one per group), a ring all-reduce of
      one stage's parameter bytes, 2(D-1)/D x bytes / bandwidth + 2(D-1) x latency (the profile's measured
      all-reduce, if any, is replaced by this formula); ``predict`` adds it to the update, or only what the next
      step's pipeline does not hide when the reference update is overlapped (``sync_reference=False``).
    * Tensor parallelism (``tensor``, T > 1): each stage's forward and backward time shrink to (1 - f + f / T) of
      the balanced stage's (f: ``tensor.fraction``, the ideal split of what the plan covers); its weights, optimizer
      state and saved activations to the mode's share, and every unit pays the mode's traffic (``tensor_modes.py``;
      under 1d ``tensor.allreduces / S'`` ring all-reduces of one boundary-sized activation over T ranks, forward
      and backward), on the tensor link; 2.5d's per-step gradient sum over d joins the optimizer step. The D-group
      all-reduce moves a rank's share of the weights.
    * Activation checkpointing of every layer (``checkpointed_layers``: the model's layer count): a unit keeps each
      layer's input, taken as one boundary-sized activation per layer (L / S' per stage), instead of what the
      layers save, and the backward runs the forward again (backward + forward time).
    * The split backward's input and weight gradients (where profiled) pool and shrink as the backward does; the
      recomputed forward of checkpointing runs in I, and T's all-reduces there.
    * Sharding: the profiled level and reduce mode are kept (``predict`` takes another); a layer is not cut, so
      the largest layer's weights (``layer_bytes``) stay, at most a stage's, shrunk by T.
    * Everything else (batch size B per pipeline, schedule, the per-iteration and per-unit overheads, the data
      fetch, ``sync_reference`` and the accumulation) is kept as measured.

    Raises:
        ValueError: ``num_stages`` or ``num_groups`` below 1, a negative latency, or a bandwidth not above 0.
    """
    if not is_int(num_stages, 1):
        raise ValueError(f"num_stages={num_stages!r} must be an int >= 1 (the number of stages to project to).")
    if not is_int(num_groups, 1):
        raise ValueError(f"num_groups={num_groups!r} must be an int >= 1 (data-parallel groups D; 1 for none).")
    if latency_s is not None and not latency_s >= 0:
        raise ValueError(f"latency_s={latency_s!r} must be >= 0 seconds (or None for the profiled latency).")
    if bandwidth is not None and not bandwidth > 0:
        raise ValueError(f"bandwidth={bandwidth!r} must be > 0 bytes/s (or None for the profiled bandwidth).")
    if not profile.stages:
        raise ValueError("the profile has no stages; profile at least one stage before projecting.")
    old = profile.stages
    S_new = num_stages
    share = 1.0 / S_new
    total_params = sum(st.param_bytes for st in old)
    boundaries = [st.send_bytes for st in old[:-1] if st.send_bytes] or [st.send_bytes for st in old if st.send_bytes]
    sent = _pooled(boundaries, 1.0 / len(boundaries)) if boundaries else {}
    stage = StageProfile(
        forward_s=_pooled([st.forward_s for st in old], share),
        backward_s=_pooled([st.backward_s for st in old], share),
        activation_bytes=_pooled([st.activation_bytes for st in old], share),
        send_bytes=sent,
        param_bytes=total_params * share,
        optimizer_state_bytes=sum(st.optimizer_state_bytes for st in old) * share,
        optimizer_step_s=sum(st.optimizer_step_s for st in old) * share,
        elastic_s=sum(st.elastic_s for st in old) * share,
        layer_bytes=min(max(st.layer_bytes for st in old), total_params * share),  # a layer is not cut
    )
    if all(st.split_profiled for st in old):  # the split backward's I and W, pooled as the backward is
        stage.input_grad_s = _pooled([st.input_grad_s for st in old], share)
        stage.weight_grad_s = _pooled([st.weight_grad_s for st in old], share)
    latency = profile.latency_s if latency_s is None else float(latency_s)
    bw = profile.bandwidth if bandwidth is None else float(bandwidth)
    tp = tensor or TensorParallel()
    if tp.size > 1:
        t_lat = latency if tp.latency_s is None else float(tp.latency_s)
        t_bw = bw if tp.bandwidth is None else float(tp.bandwidth)
        pairs, mode, whole = tp.allreduces / S_new, tp.layout, stage.param_bytes

        def comm(b: float, backward: bool) -> float:
            unit = mode.traffic(interpolate(sent, b) if sent else 0.0, whole, pairs)
            return unit[1 if backward else 0].seconds(t_lat, t_bw)

        stage.forward_s = {b: tp.shrink(v) + comm(b, False) for b, v in stage.forward_s.items()}
        stage.backward_s = {b: tp.shrink(v) + comm(b, True) for b, v in stage.backward_s.items()}
        stage.input_grad_s = {b: tp.shrink(v) + comm(b, True) for b, v in stage.input_grad_s.items()}  # I's traffic
        stage.weight_grad_s = {b: tp.shrink(v) for b, v in stage.weight_grad_s.items()}
        stage.activation_bytes = {b: v * mode.activations() for b, v in stage.activation_bytes.items()}
        held = mode.weights()
        stage.param_bytes *= held
        stage.layer_bytes *= held
        stage.optimizer_state_bytes *= held
        stage.optimizer_step_s = stage.optimizer_step_s * held + mode.step_traffic(whole).seconds(t_lat, t_bw)
        stage.elastic_s *= held
    if checkpointed_layers is not None:  # the layers' inputs (whole under 1d); the recomputed forward
        if not is_int(checkpointed_layers, 1):  # (its all-reduces included) runs again in the backward
            raise ValueError(f"checkpointed_layers={checkpointed_layers!r} must be the model's layer count (>= 1).")
        per_stage = checkpointed_layers / S_new
        kept = per_stage * tp.layout.boundary()  # layer inputs: whole under 1d, a 1/T block under sp and the grid
        stage.activation_bytes = {b: kept * interpolate(sent, b) for b in stage.activation_bytes} if sent else {}
        stage.backward_s = {b: v + interpolate(stage.forward_s, b) for b, v in stage.backward_s.items()}
        stage.input_grad_s = {b: v + interpolate(stage.forward_s, b) for b, v in stage.input_grad_s.items()}
    reduce = allreduce_seconds(stage.param_bytes, num_groups, latency, bw)
    return PipelineProfile(
        stages=[
            StageProfile(
                forward_s=dict(stage.forward_s),
                backward_s=dict(stage.backward_s),
                activation_bytes=dict(stage.activation_bytes),
                send_bytes=dict(stage.send_bytes),
                param_bytes=stage.param_bytes,
                optimizer_state_bytes=stage.optimizer_state_bytes,
                optimizer_step_s=stage.optimizer_step_s,
                elastic_s=stage.elastic_s,
                input_grad_s=dict(stage.input_grad_s),
                weight_grad_s=dict(stage.weight_grad_s),
                layer_bytes=stage.layer_bytes,
            )
            for _ in range(S_new)
        ],
        batch_size=profile.batch_size,
        latency_s=latency,
        bandwidth=bw,
        num_groups=num_groups,
        iteration_overhead_s=profile.iteration_overhead_s,
        unit_overhead_s=profile.unit_overhead_s,
        batch_fetch_s=profile.batch_fetch_s,
        schedule=profile.schedule,
        reference_allreduce_s=reduce,
        sync_reference=profile.sync_reference,
        accumulate=profile.accumulate,
        shard_optimizer_state=profile.shard_optimizer_state,
        sharding_strategy=profile.sharding_strategy,
        reduce_gradients=profile.reduce_gradients,
    )
