"""Pure units for ``lightning_avgpipe.partition``: the block-partition solver, the layer profile and their facade."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from itertools import pairwise

import pytest
import torch
from torch import nn

from lightning_avgpipe.partition import (
    PARTITION_METHODS,
    LayerCost,
    blockpartition,
    check_partition,
    partition_layers,
    profile_layers,
)


class Delay(nn.Module):
    """A layer that takes ``seconds`` to run forward (as in torchgpipe's balance tests), and has no parameters."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def _brute_force(costs: Sequence[float], blocks: int) -> float:
    """The smallest largest-block sum over every split of ``costs`` into ``blocks`` contiguous non-empty blocks."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), blocks - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in pairwise(bounds)))
    return best


def _block_sums(costs: Sequence[float], sizes: Sequence[int]) -> list[float]:
    sums, start = [], 0
    for size in sizes:
        sums.append(sum(costs[start : start + size]))
        start += size
    return sums


def _cases() -> list[tuple[list[float], int]]:
    rng = random.Random(20230225)
    cases = []
    for _ in range(150):
        n = rng.randint(1, 9)
        blocks = rng.randint(1, n)
        if rng.random() < 0.5:
            costs = [float(rng.randint(0, 20)) for _ in range(n)]  # ties and zeros
        else:
            costs = [rng.uniform(0.0, 10.0) for _ in range(n)]
        cases.append((costs, blocks))
    return cases


# -- blockpartition.solve -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("costs", "blocks"), _cases())
def test_solve_matches_brute_force(costs: list[float], blocks: int) -> None:
    sizes = blockpartition.solve(costs, blocks)
    assert len(sizes) == blocks
    assert all(isinstance(s, int) and s >= 1 for s in sizes)
    assert sum(sizes) == len(costs)
    assert max(_block_sums(costs, sizes)) == pytest.approx(_brute_force(costs, blocks), rel=1e-9, abs=1e-12)
    assert blockpartition.solve(list(costs), blocks) == sizes  # deterministic: every rank gets the same split


def test_solve_docstring_examples_and_edges() -> None:
    assert blockpartition.solve([1, 1, 1, 1], 2) == [2, 2]
    assert blockpartition.solve([4, 1, 1, 1, 1], 2) == [1, 4]
    assert blockpartition.solve([5.0], 1) == [1]
    assert blockpartition.solve([1, 2, 3], 3) == [1, 1, 1]
    assert blockpartition.solve([1, 2, 3], 1) == [3]
    assert blockpartition.solve([0, 0, 0, 0], 2) in ([1, 3], [2, 2], [3, 1])
    assert blockpartition.solve([1, 1, 10, 1, 1], 3) == [2, 1, 2]


def test_solve_rejects_more_blocks_than_layers() -> None:
    with pytest.raises(ValueError, match="Cannot split 2 layers into 3 non-empty stages; use at most 2 stages"):
        blockpartition.solve([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="Cannot split 0 layers into 1"):
        blockpartition.solve([], 1)


def test_solve_rejects_bad_blocks_and_negative_costs() -> None:
    with pytest.raises(ValueError, match="blocks=0 must be >= 1"):
        blockpartition.solve([1.0], 0)
    with pytest.raises(ValueError, match=r"costs must be non-negative, got \[1.0, -2.0\]"):
        blockpartition.solve([1.0, -2.0], 1)


@pytest.mark.parametrize(
    ("n", "blocks", "expected"),
    [(4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (3, 3, [1, 1, 1]), (10, 1, [10]), (6, 4, [2, 2, 1, 1])],
)
def test_uniform(n: int, blocks: int, expected: list[int]) -> None:
    assert blockpartition.uniform(n, blocks) == expected


def test_uniform_rejects_more_blocks_than_layers() -> None:
    with pytest.raises(ValueError, match="Cannot split 2 layers into 3 non-empty stages"):
        blockpartition.uniform(2, 3)


# -- check_partition ----------------------------------------------------------------------------------------------


def test_check_partition_accepts_valid_specs() -> None:
    for method in PARTITION_METHODS:
        check_partition(method, num_layers=4, num_stages=2)
    check_partition([1, 3], num_layers=4, num_stages=2)
    check_partition((2, 2))  # nothing to compare against yet


def test_check_partition_wrong_sum() -> None:
    with pytest.raises(ValueError, match=r"partition=\[2, 2\] sums to 4 layers but configure_pipeline\(\) returns 5"):
        check_partition([2, 2], num_layers=5, num_stages=2)


def test_check_partition_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"partition=\[1, 2, 3\] has 3 entries but num_stages=2"):
        check_partition([1, 2, 3], num_layers=6, num_stages=2)


@pytest.mark.parametrize("sizes", [[2, 0], [-1, 3], [], [1.5, 2], [True, 1], ["2", 2]])
def test_check_partition_non_positive_or_non_int_entries(sizes: list) -> None:
    with pytest.raises(ValueError, match="must list a positive layer count per stage") as info:
        check_partition(sizes)
    assert f"partition={sizes!r}" in str(info.value)


def test_check_partition_unknown_method() -> None:
    with pytest.raises(ValueError) as info:
        check_partition("greedy")
    message = str(info.value)
    assert "partition='greedy' is not a known method" in message
    for method in PARTITION_METHODS:
        assert repr(method) in message


def test_check_partition_method_with_too_few_layers() -> None:
    with pytest.raises(ValueError, match="num_stages=4 is more than the 3 layers"):
        check_partition("uniform", num_layers=3, num_stages=4)


# -- partition_layers ---------------------------------------------------------------------------------------------


def test_partition_layers_explicit_and_uniform() -> None:
    layers = [nn.Linear(2, 2) for _ in range(5)]
    assert partition_layers(layers, 2, [4, 1]) == [4, 1]
    assert partition_layers(layers, 2, (1, 4)) == [1, 4]
    assert partition_layers(layers, 3, "uniform") == [2, 2, 1]
    with pytest.raises(ValueError, match="sums to 4 layers"):
        partition_layers(layers, 2, [2, 2])
    with pytest.raises(ValueError, match="num_stages=6 is more than the 5 layers"):
        partition_layers(layers, 6, "balanced")


def test_partition_layers_by_parameters() -> None:
    layers = [nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(100, 100), nn.Linear(10, 10)]
    assert partition_layers(layers, 2, "parameters") == [2, 2]
    assert partition_layers(layers, 3, "parameters") == [2, 1, 1]
    # "balanced" without a sample cannot profile and falls back to parameters.
    assert partition_layers(layers, 3, "balanced") == [2, 1, 1]


def test_partition_layers_balanced_puts_the_slow_layer_alone() -> None:
    torch.manual_seed(0)
    # The sleeping layer has no parameters, so only profiling can see it is the expensive one. Any block holding
    # it and another layer costs more than it alone, so the optimum is unique.
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), Delay(0.03), nn.Linear(8, 8), nn.Linear(8, 8)]
    assert partition_layers(layers, 3, "balanced", sample=torch.randn(4, 8)) == [2, 1, 2]
    assert partition_layers(layers[2:], 2, "balanced", sample=torch.randn(4, 8)) == [1, 2]
    assert partition_layers(layers[:3], 2, "balanced", sample=torch.randn(4, 8)) == [2, 1]


# -- profile_layers -----------------------------------------------------------------------------------------------


def test_profile_layers_measures_time_and_parameter_bytes() -> None:
    layers = [nn.Linear(4, 4).double(), Delay(0.01), nn.Linear(4, 2).double()]
    costs = profile_layers(layers, torch.randn(3, 4, dtype=torch.float64), repeats=2)
    assert [c.param_bytes for c in costs] == [(16 + 4) * 8, 0, (8 + 2) * 8]
    assert costs[1].forward >= 0.01
    assert all(isinstance(c, LayerCost) and c.forward >= 0 and c.backward >= 0 for c in costs)
    assert costs[1].compute == costs[1].forward + costs[1].backward
    assert costs[1].forward > costs[0].forward


def test_profile_layers_leaves_gradients_exactly_as_they_were() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)]
    with_grad = layers[1]
    for p in with_grad.parameters():
        p.grad = torch.randn_like(p)
    before = {p: (None if p.grad is None else p.grad.clone()) for layer in layers for p in layer.parameters()}
    weights = [p.detach().clone() for layer in layers for p in layer.parameters()]

    profile_layers(layers, torch.randn(5, 4))

    for p, grad in before.items():
        if grad is None:
            assert p.grad is None
        else:
            assert p.grad is not None
            assert torch.equal(p.grad, grad)
    for p, w in zip((p for layer in layers for p in layer.parameters()), weights, strict=True):
        assert torch.equal(p, w)


def test_profile_layers_handles_tuple_activations() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x)

    class Add(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] + pair[1]

    costs = profile_layers([Pair(), Add(), nn.Linear(4, 1)], torch.randn(2, 4))
    assert [c.param_bytes for c in costs] == [2 * 20 * 4, 0, 5 * 4]


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": self.lin(x)}


class _DictIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(d["h"])


def test_profile_layers_handles_dict_activations() -> None:
    costs = profile_layers([_DictOut(), _DictIn()], torch.randn(3, 4))
    assert len(costs) == 2


def test_profile_layers_leaves_buffers_untouched() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)]
    before = {k: v.clone() for k, v in layers[1].state_dict().items()}
    profile_layers(layers, torch.randn(8, 4))
    after = layers[1].state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def test_profile_layers_leaves_the_rng_untouched() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)]
    sample = torch.randn(8, 4)
    state = torch.get_rng_state()
    profile_layers(layers, sample)
    assert torch.equal(torch.get_rng_state(), state)
