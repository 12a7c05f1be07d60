"""One source for every argument: PipelineConfig's fields are the strategy's pipeline arguments (same names, same
defaults), every argument of AvgPipeStrategy, AvgPipeTuner and PipelineConfig has its line in its class's docstring,
and docs/arguments.md is what ``python -m tests.helpers.arguments`` generates from them.

Each check is shown to fail on the drift it guards against (a default changed in the docs, an argument left out).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from lightning_avgpipe import AvgPipeStrategy, AvgPipeTuner
from tests.helpers import arguments

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "arguments.md"
STRATEGY_ONLY = {
    "process_group_backend",
    "check_forward",
    "trusted_checkpoints",
    "tensor_parallel_plan",
    "save_distributed_checkpoint",
    "seed_layers",
}
_ROW = re.compile(r"^\| `(\w+)`(?: \(strategy only\))? \| (.*?) \| ")


def documented_defaults(text: str, section: str) -> dict[str, str]:
    """argument -> its default cell, from the table under ``## section`` of docs/arguments.md's text."""
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in map(_ROW.match, body.splitlines()) if m}


def drift(text: str, section: str, cls: object, skip: tuple[str, ...] = ()) -> list[str]:
    """What ``text`` gets wrong about ``cls``'s arguments: missing ones and other defaults."""
    documented = documented_defaults(text, section)
    problems = []
    for name, default in arguments.defaults(cls).items():
        if name in skip:
            continue
        if name not in documented:
            problems.append(f"{section}: `{name}` is missing from docs/arguments.md")
        elif documented[name] != arguments._default(default):
            problems.append(f"{section}: `{name}` defaults to {default!r}, the docs say {documented[name]}")
    return problems


def test_config_fields_are_the_strategys_pipeline_arguments() -> None:
    strategy = arguments.defaults(AvgPipeStrategy)
    config = arguments.config_defaults()
    pipeline_args = {n: d for n, d in strategy.items() if n not in STRATEGY_ONLY and n not in arguments.LIGHTNING}
    assert list(config) == list(pipeline_args), "PipelineConfig's fields and the strategy's arguments differ in order"
    assert config == pipeline_args


@pytest.mark.parametrize("name", sorted(arguments.config_defaults()))
def test_the_strategy_passes_each_argument_into_its_config(name: str) -> None:
    """No hand copies: a value other than the default of every field reaches ``strategy.config``."""
    values = {
        "num_stages": 2,
        "num_microbatches": 3,
        "schedule": "advance",
        "advance_forwards": 2,
        "stages_per_rank": 1,
        "schedule_costs": (1.0, 1.1, 0.6),
        "memory_limit": 0.5,
        "partition": [1, 2],
        "num_pipelines": 2,
        "averaging": "exact",
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "averaging_period": 2,
        "elastic_alpha": 0.25,
        "sync_reference": True,
        "replica_execution": "batched",
        "p2p": "eager",
        "trace_dir": "traces",
        "trace_steps": [3, 4],
        "p2p_timeout": 5.0,
        "timeout": 60.0,
        "activation_checkpointing": True,
        "tensor_parallel_size": 2,
        "sequence_parallel": True,
        "tensor_parallel_mode": "2d",
        "tensor_parallel_depth": 2,
        "shard_optimizer_state": True,
        "sharding_strategy": "SHARD_OPTIM",
        "reduce_gradients": "per_step",
    }
    assert set(values) == set(arguments.config_defaults())
    # an argument only some schedules take; sequence parallelism needs tensor parallelism
    needs = {"schedule_costs": {"schedule": "zbv"}, "sequence_parallel": {"tensor_parallel_size": 2}}
    needs["tensor_parallel_mode"] = {"tensor_parallel_size": 4}  # the grid: q x q ranks, or d x q x q
    needs["tensor_parallel_depth"] = {"tensor_parallel_size": 8, "tensor_parallel_mode": "2.5d"}
    value = values[name]
    strategy = AvgPipeStrategy(**{name: value}, **needs.get(name, {}))
    got = getattr(strategy.config, name)
    assert got == (tuple(value) if isinstance(value, list) else value)
    assert got != arguments.config_defaults()[name]


@pytest.mark.parametrize("cls", [AvgPipeStrategy, AvgPipeTuner], ids=lambda c: c.__name__)
def test_every_argument_has_a_line_in_the_docstring(cls: type) -> None:
    described = arguments.docstring_args(cls)
    missing = [n for n in arguments.defaults(cls) if n not in described]
    assert not missing, f"{cls.__name__}'s docstring lacks Args lines for {missing}"
    stale = [n for n in described if n not in arguments.defaults(cls)]
    assert not stale, f"{cls.__name__}'s docstring describes arguments it does not take: {stale}"


def test_docs_arguments_is_generated_from_the_code() -> None:
    assert DOC.read_text() == arguments.render(), (
        "docs/arguments.md is stale: run `python -m tests.helpers.arguments > docs/arguments.md`"
    )


def test_docs_name_every_argument_with_its_default() -> None:
    text = DOC.read_text()
    problems = drift(text, "AvgPipeStrategy", AvgPipeStrategy, arguments.LIGHTNING) + drift(
        text, "AvgPipeTuner", AvgPipeTuner
    )
    config_line = text.split("## PipelineConfig\n", 1)[1]
    problems += [
        f"PipelineConfig: `{n}` is missing" for n in arguments.config_defaults() if f"`{n}`" not in config_line
    ]
    assert not problems, problems


def test_the_drift_check_fails_on_a_changed_default_or_a_missing_argument() -> None:
    text = arguments.render()
    assert drift(text, "AvgPipeStrategy", AvgPipeStrategy, arguments.LIGHTNING) == []
    changed = text.replace("| `num_microbatches` | `None` |", "| `num_microbatches` | `4` |")
    assert drift(changed, "AvgPipeStrategy", AvgPipeStrategy, arguments.LIGHTNING) == [
        "AvgPipeStrategy: `num_microbatches` defaults to None, the docs say `4`"
    ]
    dropped = "\n".join(line for line in text.splitlines() if not line.startswith("| `lr_scaling`"))
    assert drift(dropped, "AvgPipeTuner", AvgPipeTuner) == [
        "AvgPipeTuner: `lr_scaling` is missing from docs/arguments.md"
    ]


def test_a_config_default_changed_alone_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Change one field's default in PipelineConfig (not the strategy): the one-source test fails."""
    changed = {**arguments.config_defaults(), "p2p_timeout": 99.0}
    monkeypatch.setattr(arguments, "config_defaults", lambda: changed)
    with pytest.raises(AssertionError):
        test_config_fields_are_the_strategys_pipeline_arguments()


def test_every_pipeline_argument_is_annotated() -> None:
    """The LightningCLI reads the strategy's signature: every pipeline argument carries a type for it."""
    params = inspect.signature(AvgPipeStrategy).parameters
    assert all(params[n].annotation is not inspect.Parameter.empty for n in arguments.config_defaults())
