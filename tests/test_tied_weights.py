"""Weights shared by layers on different stages (a GPT's tied embedding and head) train as one parameter.

Every stage that uses the weight keeps a copy; the gradients are summed over those stages each step, so the
copies stay equal, and training matches single-process training of the tied model: losses, every weight (under
both names in the checkpoint), with parallel pipelines, with advance forward, and across a resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.equivalence import final_state, run_lightning
from tests.helpers.tied import TiedLM, reference_tied, tied_layers, token_loader


def _assert_matches(tmp_path: Path, results: list[dict[str, Any]], steps: int, m: int, pipelines: int = 1) -> None:
    ref_losses, ref_state = reference_tied(steps, m, pipelines)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses[-len(r["losses"]) :]))
    state = final_state(tmp_path)
    assert sorted(k for k in state if k.startswith("layers.")) == sorted(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda msg, key=key: f"{key}: {msg}")
    # the checkpoint holds the tied weight as the unsplit model does: under both names, the same values
    assert torch.equal(state["layers.0.weight"], state["layers.3.weight"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "strategy"),
    [
        (2, {"num_microbatches": 3, "schedule": "1f1b", "partition": [2, 2]}),
        (2, {"num_microbatches": 3, "schedule": "1f1b", "partition": [1, 3], "num_pipelines": 2}),
        (2, {"num_microbatches": 4, "schedule": "advance", "advance_forwards": 2, "partition": [3, 1]}),
        (
            4,
            {
                "num_microbatches": 2,
                "schedule": "advance",
                "advance_forwards": 1,
                "num_pipelines": 2,
                "partition": [1, 1, 1, 1],
            },
        ),
    ],
    ids=["S2-1f1b", "S2-N2", "S2-advance", "S4-advance-N2"],  # (S4 with 1F1B left for CI time)
)
def test_tied_embedding_and_head_match_single_process_training(
    tmp_path: Path, devices: int, strategy: dict[str, Any]
) -> None:
    steps = 4
    results = run_lightning(tmp_path, devices, strategy, steps=steps, tied=True)
    _assert_matches(tmp_path, results, steps, strategy["num_microbatches"], strategy.get("num_pipelines", 1))


@pytest.mark.slow
def test_tied_weights_resume_exactly(tmp_path: Path) -> None:
    """A run resumed from its step-2 checkpoint ends with the weights of a run that was not interrupted, which
    itself matches single-process training: the copies, replicas and optimizer states all come back."""
    strategy = {"num_microbatches": 3, "partition": [1, 3], "num_pipelines": 2}
    straight = run_lightning(tmp_path / "straight", 2, strategy, steps=4, tied=True, every_n_train_steps=2)
    _assert_matches(tmp_path / "straight", straight, 4, 3, pipelines=2)
    saved = sorted((tmp_path / "straight" / "every").glob("*step=2.ckpt"))
    assert len(saved) == 1, saved
    resumed = run_lightning(tmp_path / "resumed", 2, strategy, steps=4, tied=True, ckpt_path=str(saved[0]))
    a, b = final_state(tmp_path / "straight"), final_state(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed[0]["losses"] == straight[0]["losses"][2:]


def test_a_checkpoint_of_the_tied_model_loads_on_one_device_tied(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_avgpipe import AvgPipeStrategy

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        strategy=AvgPipeStrategy(num_microbatches=2, partition=[4], num_pipelines=2),
    )
    trainer.fit(TiedLM(), token_loader())
    trainer.save_checkpoint(tmp_path / "tied.ckpt")
    loaded = TiedLM.load_from_checkpoint(tmp_path / "tied.ckpt")
    assert loaded.layers[0].weight is loaded.layers[3].weight
    _, ref_state = reference_tied(2, 2, pipelines=2)
    torch.testing.assert_close(loaded.layers[0].weight.detach(), ref_state["layers.0.weight"])


def test_replicas_keep_a_weight_two_layers_of_one_stage_share() -> None:
    from lightning_avgpipe.algorithms.elastic import ElasticAveraging

    layers = tied_layers()
    elastic = ElasticAveraging(layers, num_replicas=3)
    assert len(elastic.reference_params) == len({id(p) for p in elastic.reference_params})
    for replica in elastic.replicas:
        assert replica[0].weight is replica[3].weight and replica[0].weight is not layers[0].weight
        assert len(elastic.replica_params(0)) == len(elastic.reference_params)


def test_shared_weights_are_found_by_the_stages_that_hold_them() -> None:
    from lightning_avgpipe.plugin.split.stages import shared_across_stages

    model = TiedLM()
    layers = list(model.layers)
    assert shared_across_stages(model, layers, [4]) == {}  # one stage: nothing to keep in step
    ties = shared_across_stages(model, layers, [1, 1, 1, 1])
    assert list(ties) == [(0, 3)]
    [(names, param)] = ties[(0, 3)]
    assert names == "layers.0.weight = layers.3.weight" and param is model.layers[0].weight
    assert list(shared_across_stages(model, layers, [3, 1])) == [(0, 1)]


def test_partition_by_parameters_counts_a_copy_on_each_stage() -> None:
    from lightning_avgpipe.partition import param_bytes, partition_layers

    layers = tied_layers()
    matrix = layers[0].weight.numel() * layers[0].weight.element_size()
    assert param_bytes(layers[0]) == matrix and param_bytes(layers[3]) == matrix  # each stage holds a copy
    assert partition_layers(layers, 2, "parameters") == [2, 2]  # 832 + 1216 bytes a stage: both copies weigh


def test_a_norm_counts_a_shared_weight_once() -> None:
    from lightning_avgpipe.runtime.sync.clipping import clip_grad_norm_across

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((4,), 1.0)
    norm = clip_grad_norm_across([[a, b]], max_norm=100.0, uncounted={id(a)})
    assert float(norm[0]) == pytest.approx(2.0)  # sqrt(4 x 1): a's copy is counted on another stage
