"""The elastic-averaging rule on one process: the reference stays the replicas' mean and follows the rule.

Design: docs/how-it-works.md#elastic-averaging-rule.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_avgpipe.elastic import ElasticAveraging, check_alpha, default_alpha


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
