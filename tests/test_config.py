"""Pure units for ``lightning_avgpipe.config``: PipelineConfig validates early, normalises and stays frozen."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.schedules import SCHEDULES


def test_defaults() -> None:
    config = PipelineConfig()
    assert config.num_stages is None
    assert config.num_microbatches is None
    assert config.schedule == "1f1b"
    assert config.advance_forwards == "auto" and config.memory_limit is None
    assert config.partition == "balanced"
    assert config.timeout == 1800.0
    assert config.microbatches_for(3) == 6  # None means 2 x stages
    assert PipelineConfig(num_microbatches=5).microbatches_for(3) == 5


@pytest.mark.parametrize(
    ("given", "expected"),
    [("gpipe", "afab"), ("GPipe", "afab"), ("AFAB", "afab"), ("1F1B", "1f1b"), ("advance", "advance")],
)
def test_schedule_aliases_are_normalised(given: str, expected: str) -> None:
    assert PipelineConfig(schedule=given).schedule == expected


def test_partition_list_becomes_a_tuple() -> None:
    config = PipelineConfig(num_stages=2, partition=[3, 5])
    assert config.partition == (3, 5)
    assert hash(config) == hash(PipelineConfig(num_stages=2, partition=(3, 5)))
    assert PipelineConfig(partition="uniform").partition == "uniform"


def test_is_frozen() -> None:
    config = PipelineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.schedule = "afab"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_microbatches = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(num_microbatches=0), ["num_microbatches=0", ">= 1"]),
        (dict(num_microbatches=-3), ["num_microbatches=-3"]),
        (dict(num_microbatches=2.0), ["num_microbatches=2.0"]),
        (dict(num_microbatches=True), ["num_microbatches=True"]),
        (dict(num_stages=0), ["num_stages=0", ">= 1"]),
        (dict(schedule="zigzag"), ["schedule='zigzag'", *(repr(s) for s in SCHEDULES)]),
        (dict(advance_forwards=-1), ["advance_forwards=-1", ">= 0"]),
        (dict(advance_forwards=1.5), ["advance_forwards=1.5"]),
        (dict(partition=[2, 0]), ["partition=[2, 0]", "positive layer count"]),
        (dict(partition=[]), ["partition=[]"]),
        (dict(partition="greedy"), ["partition='greedy'", "'balanced'", "'parameters'", "'uniform'"]),
        (dict(num_stages=2, partition=[1, 2, 3]), ["partition=[1, 2, 3]", "num_stages=2"]),
        (dict(timeout=0), ["timeout=0", "positive"]),
        (dict(timeout=-1.5), ["timeout=-1.5"]),
        (dict(timeout=float("nan")), ["timeout=nan"]),
        (dict(averaging="mean"), ["averaging='mean'", "'elastic'", "'exact'"]),
        (dict(averaging="exact", outer_momentum=0.9), ["averaging='exact'", "outer_momentum=0.9", "'elastic'"]),
        (dict(averaging_period=0), ["averaging_period=0", ">= 1"]),
        (dict(outer_momentum=1.0), ["outer_momentum=1.0", "[0, 1)"]),
        (dict(outer_lr=-1), ["outer_lr=-1", "positive"]),
    ],
)
def test_rejects_bad_values_naming_argument_and_value(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        PipelineConfig(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("name", ["num_stages", "advance_forwards"])
def test_rejects_bools_like_num_microbatches(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}=True"):
        PipelineConfig(**{name: True})


def test_rejects_a_non_numeric_timeout_naming_it() -> None:
    with pytest.raises((TypeError, ValueError), match="timeout='10'"):
        PipelineConfig(timeout="10")  # type: ignore[arg-type]


def test_share_cpu_threads_sets_the_share_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import torch

    from lightning_avgpipe import share_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # recorded, so the original (set or not) comes back afterwards
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    try:
        assert share_cpu_threads(4) == 2
        assert os.environ["OMP_NUM_THREADS"] == "2" and torch.get_num_threads() == 2
        monkeypatch.setattr(os, "cpu_count", lambda: 1)
        assert share_cpu_threads(4) == 2  # OMP_NUM_THREADS is now set: left alone
        with pytest.raises(ValueError, match=r"processes=0 must be an int >= 1"):
            share_cpu_threads(0)
    finally:
        torch.set_num_threads(before)
