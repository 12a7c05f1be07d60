"""The gradient noise scale: the estimator against closed form, and the pipeline's measurement against one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_avgpipe.algorithms.noise_scale import GradientNorms, NoiseScale, efficiency
from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.controller import StepController
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.runtime.sync.gradient_probe import GradientProbe
from tests.helpers.distributed import run_distributed
from tests.helpers.models import make_batch, make_layers

# -- the estimator, on linear regression with Gaussian noise ------------------------------------------------------
#
# y = x·w* + ε, x ~ N(0, I_d), ε ~ N(0, σ²), loss ½(x·w - y)². At w = w* + δ a sample's gradient is x (x·δ - ε), so
# G = δ and E[g gᵀ] = |δ|² I + 2 δδᵀ + σ² I (Isserlis): tr Σ = (d + 1)|δ|² + d σ², and B_simple = tr Σ / |δ|².
D, SIGMA = 10, 2.0


def analytic_noise_scale(delta: torch.Tensor) -> float:
    d2 = float(delta.square().sum())
    return ((D + 1) * d2 + D * SIGMA**2) / d2


def regression_grads(w: nn.Parameter, w_star: torch.Tensor, batch: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(batch, D, generator=g, dtype=torch.float64)
    y = x @ w_star + SIGMA * torch.randn(batch, generator=g, dtype=torch.float64)
    loss = 0.5 * (x @ w - y).square().mean()
    (grad,) = torch.autograd.grad(loss, [w])
    return grad


@pytest.mark.parametrize("form", ["replicas", "halves"])
def test_the_estimate_is_within_ten_percent_of_the_analytic_noise_scale(form: str) -> None:
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(D, generator=g, dtype=torch.float64)
    delta = 0.5 * torch.randn(D, generator=g, dtype=torch.float64)
    w = nn.Parameter(w_star + delta)
    noise = NoiseScale(decay=0.999)  # about the last 1000 steps: one step alone is noisy
    for _ in range(3000):
        if form == "replicas":  # N = 4 pipelines of B = 8: each replica's gradient and their mean
            grads = [regression_grads(w, w_star, 8, g) for _ in range(4)]
            small = sum(float(x.square().sum()) for x in grads) / 4
            big = float((sum(grads) / 4).square().sum())
            noise.update(GradientNorms(small, 8, big, 32))
        else:  # one pipeline of B = 16 in two halves of 8
            halves = [regression_grads(w, w_star, 8, g) for _ in range(2)]
            small = sum(float(x.square().sum()) for x in halves) / 2
            big = float(((halves[0] + halves[1]) / 2).square().sum())
            noise.update(GradientNorms(small, 8, big, 16))
    expected = analytic_noise_scale(delta)
    assert noise.value is not None
    assert abs(noise.value - expected) / expected < 0.10, (noise.value, expected)
    assert noise.grad_sq is not None and noise.trace is not None
    assert abs(noise.grad_sq - float(delta.square().sum())) / float(delta.square().sum()) < 0.15


def test_one_step_estimates_are_unbiased_in_closed_form() -> None:
    # E|G_b|² = |G|² + S/b exactly: the estimator returns (|G|², S) from the two expectations
    norms = GradientNorms(small_sq=2.0 + 30.0 / 4, small_batch=4, big_sq=2.0 + 30.0 / 16, big_batch=16)
    grad_sq, trace = norms.estimates()
    assert grad_sq == pytest.approx(2.0) and trace == pytest.approx(30.0)
    noise = NoiseScale(decay=0.5)
    assert noise.update(norms) == pytest.approx(15.0)
    state = noise.state_dict()
    other = NoiseScale()
    other.load_state_dict(state)
    assert other.value == pytest.approx(15.0) and other.measurements == 1


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="decay=1.5"):
        NoiseScale(decay=1.5)
    with pytest.raises(ValueError, match="small_batch < big_batch"):
        GradientNorms(1.0, 8, 1.0, 8).estimates()
    with pytest.raises(ValueError, match="batch sizes must be positive"):
        efficiency(10.0, 0, 4)


def test_efficiency_follows_mccandlish() -> None:
    assert efficiency(100.0, 32, 32) == 1.0
    assert efficiency(100.0, 32, 128) == pytest.approx(132 / 228)
    assert efficiency(None, 32, 128) == 1.0  # no estimate: said so by the caller, counted as no loss
    assert efficiency(0.0, 32, 128) == pytest.approx(0.25)  # no noise: a bigger batch only repeats work
    assert efficiency(1e9, 32, 128) == pytest.approx(1.0, abs=1e-6)
    assert not math.isnan(efficiency(float("inf"), 1, 2))


def test_a_negative_first_estimate_gives_no_value() -> None:
    noise = NoiseScale()
    assert noise.update(GradientNorms(small_sq=1.0, small_batch=4, big_sq=1.5, big_batch=16)) is None


# -- the pipeline's measurement equals one process's --------------------------------------------------------------
def _loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor], share: float) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _apply(layers: list[nn.Module], x: object) -> object:
    for layer in layers:
        x = layer(x)
    return x


def direct_norms(n: int, m: int) -> GradientNorms:
    """In one process, without the pipeline: the gradients of each batch (N > 1) or of each half (N = 1)."""
    layers = make_layers()
    params = [p for layer in layers for p in layer.parameters()]

    def grad(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad(F.cross_entropy(_apply(layers, x), y), params))

    def sq(gs: list[torch.Tensor]) -> float:
        return float(sum(g.double().square().sum() for g in gs))

    if n > 1:
        batches = [make_batch(i) for i in range(n)]
        grads = [grad(x, y) for x, y in batches]
        mean = [sum(gs) / n for gs in zip(*grads)]
        return GradientNorms(sum(sq(g) for g in grads) / n, 12, sq(mean), 12 * n)
    x, y = make_batch(0)
    half = len(x) // m * (m // 2)
    g1, g2, whole = grad(x[:half], y[:half]), grad(x[half:], y[half:]), grad(x, y)
    return GradientNorms((sq(g1) + sq(g2)) / 2, 2 / (1 / half + 1 / (len(x) - half)), sq(whole), len(x))


def _pipeline_worker(rank: int, world: int, n: int, m: int, schedule: str) -> tuple[float, float, float, float]:
    layers = make_layers()
    own = layers[:3] if rank == 0 else layers[3:]
    cfg = PipelineConfig(num_stages=world, num_microbatches=m, schedule=schedule, num_pipelines=n)
    control = StepController(StagePipeline(own, Topology(rank, world, world), cfg))
    batches = [make_batch(i) for i in range(n)]
    result = control.train_step(batches, _loss, log=False, noise=True).result
    assert result.noise is not None
    assert control.noise_scale.measurements == 1
    r = result.noise
    return (r.small_sq, r.small_batch, r.big_sq, r.big_batch)


@pytest.mark.parametrize(
    ("n", "m", "schedule"), [(2, 2, "1f1b"), (1, 4, "1f1b"), (1, 4, "afab"), (3, 1, "1f1b")], ids=str
)
def test_two_ranks_measure_what_one_process_computes(n: int, m: int, schedule: str) -> None:
    expected = direct_norms(n, m)
    runs = run_distributed(_pipeline_worker, 2, n, m, schedule, timeout=120)
    for got in runs:  # every rank has the whole job's figures
        assert got[1] == pytest.approx(expected.small_batch) and got[3] == pytest.approx(expected.big_batch)
        assert got[0] == pytest.approx(expected.small_sq, rel=1e-5)
        assert got[2] == pytest.approx(expected.big_sq, rel=1e-5)


def test_one_pipeline_of_one_microbatch_measures_nothing() -> None:
    assert not GradientProbe.usable(1, 1)
    layers = make_layers()
    control = StepController(StagePipeline(layers, Topology(0, 1, 1), PipelineConfig(num_microbatches=1)))
    result = control.train_step([make_batch(0)], _loss, log=False, noise=True).result
    assert result.noise is None and control.noise_scale.measurements == 0


def test_a_shared_weight_is_counted_once() -> None:
    w = nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 2.0)
    other = nn.Parameter(torch.ones(2))
    other.grad = torch.ones(2)
    probe = GradientProbe([[w, other], [w, other]], [4, 4], [0, 1], skip={id(w)})
    values, _, _ = probe.local()
    assert float(values[0]) == pytest.approx(2.0)  # only `other`: 1² + 1²
