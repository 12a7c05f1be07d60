"""The elastic-averaging rule on one process: the reference stays the replicas' mean and follows the rule.

Design: docs/how-it-works.md#elastic-averaging-rule.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_avgpipe.algorithms.elastic import ElasticAveraging, check_alpha, default_alpha


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)]


def _train(elastic: ElasticAveraging, opt_cls: type, steps: int, check_mean: bool) -> list[list[torch.Tensor]]:
    opts = [opt_cls(elastic.replica_params(n), lr=0.05) for n in range(elastic.num_replicas)]
    history = []
    for step in range(steps):
        for n in range(elastic.num_replicas):
            g = torch.Generator().manual_seed(100 * step + n)  # each replica sees its own batch
            x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
            out = x
            for layer in elastic.replicas[n]:
                out = layer(out)
            opts[n].zero_grad()
            nn.functional.mse_loss(out, y).backward()
        elastic.begin_step()
        for opt in opts:
            opt.step()
        elastic.finish_step()
        if check_mean:
            for i, ref in enumerate(elastic.reference_params):
                mean = torch.stack([elastic.replica_params(n)[i].detach() for n in range(elastic.num_replicas)]).mean(0)
                torch.testing.assert_close(ref.detach(), mean)
        history.append([p.detach().clone() for p in elastic.reference_params])
    return history


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("n", [2, 3])
def test_reference_is_the_mean_of_the_replicas(opt_cls: type, n: int) -> None:
    elastic = ElasticAveraging(_layers(), num_replicas=n)
    _train(elastic, opt_cls, steps=5, check_mean=True)
    spread = max(
        (elastic.replica_params(a)[0] - elastic.replica_params(b)[0]).abs().max().item()
        for a in range(n)
        for b in range(n)
    )
    assert spread > 1e-4  # the replicas really trained on different data


def test_rule_by_hand_with_custom_alpha() -> None:
    """Two replicas, alpha = 0.3, SGD: compare with the formula written out with explicit tensors."""
    layers = _layers()
    elastic = ElasticAveraging(layers, num_replicas=2, alpha=0.3)
    w = [[p.detach().clone() for p in elastic.replica_params(n)] for n in range(2)]
    ref = [p.detach().clone() for p in elastic.reference_params]
    for n in range(2):
        for p in elastic.replica_params(n):
            p.grad = torch.full_like(p, 0.1 * (n + 1))
    opts = [torch.optim.SGD(elastic.replica_params(n), lr=1.0) for n in range(2)]
    elastic.begin_step()
    for opt in opts:
        opt.step()
    elastic.finish_step()
    for i in range(len(ref)):
        deltas = [-0.1 * (n + 1) * torch.ones_like(ref[i]) for n in range(2)]
        for n in range(2):
            expected = w[n][i] + deltas[n] - 0.3 * (w[n][i] - ref[i])
            torch.testing.assert_close(elastic.replica_params(n)[i].detach(), expected)
        torch.testing.assert_close(elastic.reference_params[i].detach(), ref[i] + sum(deltas) / 2)


def test_single_replica_is_the_reference_itself() -> None:
    layers = _layers()
    elastic = ElasticAveraging(layers, num_replicas=1)
    assert elastic.trivial and elastic.replicas[0] is elastic.reference
    assert elastic.replica_params(0)[0] is layers[0].weight


def test_replicas_start_as_copies_and_reset() -> None:
    elastic = ElasticAveraging(_layers(), num_replicas=2)
    with torch.no_grad():
        elastic.replica_params(1)[0].add_(1.0)
    elastic.reset_replicas()
    for n in range(2):
        for p, r in zip(elastic.replica_params(n), elastic.reference_params):
            assert p is not r and torch.equal(p, r)


def test_divergence_is_zero_at_start_and_grows() -> None:
    elastic = ElasticAveraging(_layers(), num_replicas=2)
    assert all(d[0].item() == 0.0 and d[1].item() > 0 for d in elastic.divergence())
    _train(elastic, torch.optim.SGD, steps=2, check_mean=False)
    assert all(d[0].item() > 0 for d in elastic.divergence())


def test_alpha_validation() -> None:
    assert default_alpha(4, 2) == 1 / 8
    for bad in (0, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="elastic_alpha="):
            check_alpha(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_pipelines=0"):
        ElasticAveraging(_layers(), num_replicas=0)


def test_divergence_sums_squares_of_the_differences_exactly() -> None:
    elastic = ElasticAveraging(_layers(), num_replicas=2)
    with torch.no_grad():
        for i, p in enumerate(elastic.replica_params(1)):
            p.add_(0.01 * (i + 1))
    ref = [p.detach() for p in elastic.reference_params]
    ref_sq = sum(float((r.double() ** 2).sum()) for r in ref)
    for n, (diff_sq, got_ref_sq) in enumerate(elastic.divergence()):
        pairs = zip(elastic.replica_params(n), ref)
        want = sum(float(((p.detach().double() - r.double()) ** 2).sum()) for p, r in pairs)
        assert float(diff_sq) == pytest.approx(want, rel=1e-5, abs=1e-12)
        assert float(got_ref_sq) == pytest.approx(ref_sq, rel=1e-5)
    assert float(elastic.divergence()[1][0]) > 0 and float(elastic.divergence()[0][0]) == 0.0


def test_replicas_follow_the_references_flags_and_modes() -> None:
    layers = [nn.Linear(3, 4), nn.BatchNorm1d(4)]
    elastic = ElasticAveraging(layers, num_replicas=2)
    layers[0].weight.requires_grad_(False)  # a fine-tuning callback freezes a layer
    layers[1].eval()  # and puts BatchNorm in eval mode
    assert all(r[0].weight.requires_grad and r[1].training for r in elastic.replicas)  # copies made at setup
    elastic.follow_reference()
    for replica in elastic.replicas:
        assert not replica[0].weight.requires_grad and replica[0].bias.requires_grad
        assert not replica[1].training and replica[0].training


# -- the outer optimizer and the averaging period, written out by hand ---------------------------------------------
def _by_hand(
    steps: int, period: int, lr_out: float, mu: float, nesterov: bool, alpha: float = 0.5
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Two replicas of a parameter vector, SGD(lr=1) on gradients g = 0.1 (n + 1) (step + 1) w, the rule by hand."""
    torch.manual_seed(0)
    ref = torch.randn(6)
    w = [ref.clone(), ref.clone()]
    anchor = [w[0] - ref, w[1] - ref]
    v = torch.zeros(6)
    for step in range(steps):
        if step % period == 0:  # a period starts: the offsets d_n = w_n - w_ref
            anchor = [w[n] - ref for n in range(2)]
        w = [w[n] - 0.1 * (n + 1) * (step + 1) * w[n] for n in range(2)]  # each replica's local step
        if (step + 1) % period == 0:
            deltas = [w[n] - ref - anchor[n] for n in range(2)]  # the period's whole update
            w = [w[n] - alpha * anchor[n] for n in range(2)]
            u = (deltas[0] + deltas[1]) / 2
            v = mu * v + u
            big_u = lr_out * ((u + mu * v) if (nesterov and mu > 0) else (v if mu > 0 else u))
            ref = ref + big_u
            w = [w[n] + big_u - u for n in range(2)]  # the replicas move with the reference's extra step
    return [[x] for x in w], [ref]


def _two_replicas(**options: object) -> ElasticAveraging:
    """Two replicas of the parameter vector ``_by_hand`` starts from (seed 0)."""
    torch.manual_seed(0)
    holder = nn.Module()
    holder.w = nn.Parameter(torch.randn(6))
    return ElasticAveraging([holder], 2, **options)  # type: ignore[arg-type]


def _steps(elastic: ElasticAveraging, first: int, last: int) -> None:
    """Steps ``first .. last - 1`` of ``_by_hand``'s SGD(lr=1) on gradients 0.1 (n + 1) (step + 1) w."""
    opts = [torch.optim.SGD(elastic.replica_params(n), lr=1.0) for n in range(2)]
    for step in range(first, last):
        for n in range(2):
            (p,) = elastic.replica_params(n)
            p.grad = 0.1 * (n + 1) * (step + 1) * p.detach().clone()
        elastic.begin_step()
        for opt in opts:
            opt.step()
        elastic.finish_step()


def _by_class(
    steps: int, period: int, lr_out: float, mu: float, nesterov: bool, alpha: float = 0.5
) -> ElasticAveraging:
    elastic = _two_replicas(alpha=alpha, outer_lr=lr_out, outer_momentum=mu, nesterov=nesterov, period=period)
    _steps(elastic, 0, steps)
    return elastic


@pytest.mark.parametrize(
    ("period", "lr_out", "mu", "nesterov"),
    [
        (1, 1.0, 0.0, True),
        (1, 0.7, 0.9, True),
        (1, 0.7, 0.9, False),
        (1, 0.5, 0.0, True),
        (3, 1.0, 0.0, True),
        (2, 0.7, 0.9, True),
    ],
    ids=["paper", "diloco-nesterov", "heavy-ball", "outer-lr-only", "period-3", "diloco-period-2"],
)
def test_outer_optimizer_and_period_follow_the_formula(period: int, lr_out: float, mu: float, nesterov: bool) -> None:
    steps = 7  # ends mid-period for H = 2 and 3: the local steps since the last pull are left as they are
    want_w, want_ref = _by_hand(steps, period, lr_out, mu, nesterov)
    elastic = _by_class(steps, period, lr_out, mu, nesterov)
    torch.testing.assert_close(elastic.reference_params[0].detach(), want_ref[0])
    for n in range(2):
        torch.testing.assert_close(elastic.replica_params(n)[0].detach(), want_w[n][0])
    assert elastic.local_steps == steps % period
    assert elastic.paper_rule == (period == 1 and lr_out == 1.0 and mu == 0.0)
    if steps % period == 0:  # right after a pull the reference is the replicas' mean, whatever the outer optimizer
        mean = (elastic.replica_params(0)[0] + elastic.replica_params(1)[0]) / 2
        torch.testing.assert_close(elastic.reference_params[0].detach(), mean.detach())


def test_state_dict_resumes_mid_period_exactly() -> None:
    whole = _by_class(7, 3, 0.7, 0.9, True)
    first = _by_class(4, 3, 0.7, 0.9, True)  # stops one step into the second period, with momentum
    state = first.state_dict()
    assert state["local_steps"] == 1 and state["offsets"] is not None and state["momentum"] is not None
    resumed = _two_replicas(alpha=0.5, outer_lr=0.7, outer_momentum=0.9, period=3)
    with torch.no_grad():
        resumed.reference_params[0].copy_(first.reference_params[0])
        for n in range(2):
            resumed.replica_params(n)[0].copy_(first.replica_params(n)[0])
    resumed.load_state_dict(state)
    _steps(resumed, 4, 7)
    torch.testing.assert_close(resumed.reference_params[0], whole.reference_params[0], rtol=0, atol=0)
    for n in range(2):
        torch.testing.assert_close(resumed.replica_params(n)[0], whole.replica_params(n)[0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"period": 0}, "averaging_period=0"),
        ({"outer_momentum": 1.0}, "outer_momentum=1.0"),
        ({"outer_momentum": -0.1}, "outer_momentum=-0.1"),
        ({"outer_lr": 0.0}, "outer_lr=0.0"),
    ],
)
def test_outer_and_period_validation_names_the_argument(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ElasticAveraging(_layers(), 2, **kwargs)


def test_groups_without_their_process_group_are_refused() -> None:
    """D > 1 with group=None would leave the D groups' updates apart without a word (a Topology made directly, not
    by Topology.build, has no groups)."""
    from lightning_avgpipe.algorithms.elastic import average_gradients

    with pytest.raises(ValueError, match=r"num_groups=2 pipeline groups need the stage process group.*Topology.build"):
        ElasticAveraging(_layers(), num_replicas=2, num_groups=2)
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"num_groups=2 pipeline groups need the stage process group"):
        average_gradients([w], None, 2)
