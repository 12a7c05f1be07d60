"""Activation checkpointing per stage: the same training to the bit, less stash, and clear errors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.runtime.recompute import check_matches, layer_mask, stage_function
from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import assert_matches, run_lightning
from tests.helpers.executor import cases_worker, reference
from tests.helpers.models import make_batch


def _dropout_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Linear(8, 64),
        nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.Tanh()),
        nn.Sequential(nn.Linear(64, 64), nn.GELU()),
        nn.Linear(64, 4),
    ]


def _train(spec: Any, steps: int = 3) -> tuple[list[torch.Tensor], int, list[bool]]:
    torch.manual_seed(1)  # the same dropout masks in every run
    cfg = PipelineConfig(num_microbatches=4, activation_checkpointing=spec, partition=[4])
    pipe = StagePipeline(copy.deepcopy(_dropout_layers()), Topology(0, 1, 1), cfg)
    opt = torch.optim.SGD(pipe.reference_params, lr=0.1, momentum=0.9)
    x, y = make_batch(0, 16)
    for _ in range(steps):
        opt.zero_grad()
        pipe.train_step([(x, y)], lambda out, micro, share: F.cross_entropy(out, micro[1]), measure=True)
        opt.step()
    return [p.detach().clone() for p in pipe.reference_params], pipe.meter.peak, pipe.recompute


def test_checkpointing_trains_the_same_to_the_bit_and_keeps_less() -> None:
    plain, plain_peak, mask = _train(False)
    assert mask == [False] * 4
    middle = [False, True, True, False]
    for spec, expected in ((True, [True] * 4), (["Sequential"], middle), ([nn.Sequential], middle)):
        weights, peak, mask = _train(spec)
        assert mask == expected
        for a, b in zip(weights, plain):  # dropout included: the recomputation replays the RNG state
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert peak < plain_peak, (spec, peak, plain_peak)


def test_the_stash_is_the_checkpointed_layers_inputs() -> None:
    """Every layer checkpointed: a unit keeps each layer's input (the meter counts them) and the loss's saves."""
    _, peak, _ = _train(True, steps=1)
    rows = 16 // 4
    inputs = rows * (8 + 64 + 64 + 64) * 4  # float32 inputs of the four layers, one micro-batch
    # 1 stage: 1F1B runs each unit's backward right after its forward, so one unit is in flight
    assert inputs <= peak <= inputs + rows * 4 * 4 * 4  # + the loss's saved logits and targets at most


def test_bad_specs_and_layers_are_named() -> None:
    with pytest.raises(ValueError, match=r"activation_checkpointing=\[1\] must be True"):
        PipelineConfig(activation_checkpointing=[1])
    with pytest.raises(ValueError, match=r"replica_execution='batched' is not supported"):
        PipelineConfig(activation_checkpointing=True, replica_execution="batched", num_pipelines=2)
    with pytest.raises(ValueError, match=r"names \['Block'\], which no layer of configure_pipeline\(\) is"):
        check_matches(_dropout_layers(), ("Block", "Linear"))
    check_matches(_dropout_layers(), ("Module",))  # a base class names every layer
    assert layer_mask(_dropout_layers(), ("Linear",)) == [True, False, False, True]

    class Named(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"x": x}

    fn = stage_function([nn.Linear(2, 2), Named()], [False, True])
    with pytest.raises(TypeError, match=r"layer 1 of this stage \(Named\) returned dict, not a tensor"):
        fn(torch.randn(3, 2))
    with torch.no_grad():  # evaluation does not checkpoint, so nothing to refuse
        assert isinstance(fn(torch.randn(3, 2)), dict)


@pytest.mark.timeout(120)
def test_two_stages_with_checkpointing_match_plain_training() -> None:
    """Every layer (tuples and an int tensor cross the checkpointed Fork and Join), or the Linear layers only, under
    1F1B, AFAB and advance forwards."""
    # stage_worker's cases (tests/helpers/executor.py): (schedule, partition, M, batch sizes, batched p2p, k,
    # checkpointing)
    cases = [
        ("1f1b", [3, 3], 4, None, False, 0, True),
        ("afab", [1, 5], 3, None, False, 0, ("Linear",)),
        ("advance", [3, 3], 4, None, False, 2, True),
    ]
    got = run_distributed(cases_worker, 2, cases, timeout=100)
    for index, case in enumerate(cases):
        ref_losses, ref_states = reference(case[2])
        torch.testing.assert_close(torch.tensor(got[1][index]["losses"]), torch.tensor(ref_losses))
        states = {**got[0][index]["states"], **got[1][index]["states"]}
        for i, ref in enumerate(ref_states):
            for key, value in ref.items():
                torch.testing.assert_close(states[i][key], value, msg=lambda m, c=case, i=i, k=key: f"{c} {i}.{k}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_strategy_with_checkpointing_matches_plain_training(tmp_path: Path) -> None:
    strategy = {"num_microbatches": 2, "partition": [3, 3], "activation_checkpointing": ["Linear"]}
    results = run_lightning(tmp_path, 2, strategy)
    assert_matches(tmp_path, results, 2)


def test_the_memory_model_predicts_the_checkpointed_stash() -> None:
    """The per-layer profile predicts how much checkpointing the transformer blocks saves, within 10% of the meter."""
    from lightning_avgpipe.tuning.model import checkpointed_unit_bytes
    from lightning_avgpipe.tuning.profiler import profile_layers

    torch.manual_seed(0)

    def layers() -> list[nn.Module]:
        torch.manual_seed(0)
        block = dict(d_model=64, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True)
        return [nn.Linear(16, 64), nn.TransformerEncoderLayer(**block), nn.TransformerEncoderLayer(**block)] + [
            nn.Linear(64, 10)
        ]

    m, rows, seq = 2, 8, 24
    x, y = torch.randn(rows, seq, 16), torch.randint(0, 10, (rows, seq))
    micro = x[: rows // m]
    costs = profile_layers(layers(), micro)
    mask = [False, True, True, False]
    saved = [c.activation_bytes for c in costs]
    outs = [c.output_bytes for c in costs]
    inp = micro.numel() * micro.element_size()
    predicted = checkpointed_unit_bytes(saved, outs, inp, [False] * 4) - checkpointed_unit_bytes(saved, outs, inp, mask)

    def peak(spec: Any) -> int:
        cfg = PipelineConfig(num_microbatches=m, activation_checkpointing=spec, partition=[4])
        pipe = StagePipeline(layers(), Topology(0, 1, 1), cfg)
        loss = lambda out, mb, share: F.cross_entropy(out.reshape(-1, 10), mb[1].reshape(-1))  # noqa: E731
        pipe.train_step([(x, y)], loss, measure=True)
        return pipe.meter.peak

    measured = peak(False) - peak(["TransformerEncoderLayer"])
    assert predicted > 0 and measured == pytest.approx(predicted, rel=0.10), (measured, predicted)


# -- activation_checkpointing="auto" --------------------------------------------------------------------------------
def _auto_fit(root: Path, limit: float | None, tuner: Any = None) -> tuple[Any, Any]:
    from lightning_avgpipe import AvgPipeStrategy
    from tests.helpers.lit import PipeNet, loader, quiet_trainer

    torch.manual_seed(0)
    model = PipeNet(optimizer="adam", lr=0.01)
    strategy = AvgPipeStrategy(num_microbatches=2, activation_checkpointing="auto", memory_limit=limit)
    trainer = quiet_trainer(
        root,
        max_steps=4,
        strategy=strategy,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        callbacks=[tuner] if tuner is not None else [],
    )
    trainer.fit(model, loader())
    return strategy, model


def test_auto_checkpoints_a_stage_over_its_memory_limit_and_trains_the_same(tmp_path: Path) -> None:
    """A limit below the stage's measured peak turns checkpointing on for its layers at the second step; a limit
    above it, or none, leaves it off; the weights are bit-identical either way (recomputation changes no value)."""
    over, model_over = _auto_fit(tmp_path / "over", 1000.0)  # 1000 bytes: below any peak
    assert over.pipeline.recompute == [True] * 6 and not over.controller.measuring_memory
    under, model_under = _auto_fit(tmp_path / "under", 2**40)
    assert under.pipeline.recompute == [False] * 6 and not under.controller.measuring_memory
    unset, _ = _auto_fit(tmp_path / "unset", None)
    assert unset.pipeline.recompute == [False] * 6
    for key, value in model_under.state_dict().items():
        assert torch.equal(model_over.state_dict()[key], value), key


def test_checkpointed_profile_keeps_one_boundary_per_layer_and_recomputes() -> None:
    from lightning_avgpipe.tuning.model import PipelineProfile, StageProfile, checkpointed

    def stage(send: float | None) -> StageProfile:
        return StageProfile(
            forward_s={2.0: 1.0},
            backward_s={2.0: 2.0},
            activation_bytes={2.0: 1000.0},
            send_bytes={2.0: send} if send else {},
            param_bytes=10.0,
            optimizer_state_bytes=20.0,
            optimizer_step_s=0.0,
        )

    profile = PipelineProfile([stage(40.0), stage(30.0), stage(None)], batch_size=4)
    ac = checkpointed(profile, [2, 3, 50])
    # stage 0 keeps its own output's size per layer, the others their input's (the previous stage's output);
    # never more than without checkpointing
    assert [st.activation_bytes[2.0] for st in ac.stages] == [80.0, 120.0, 1000.0]
    assert all(st.backward_s[2.0] == 3.0 for st in ac.stages)
    assert profile.stages[0].activation_bytes[2.0] == 1000.0  # the input profile is left as it was


def test_the_tuner_turns_checkpointing_on_when_nothing_fits_without_it(tmp_path: Path) -> None:
    """activation_checkpointing="auto": a memory_limit between the smallest setting's predicted peak with and without
    checkpointing makes the tuner choose a setting that fits only checkpointed, and turn checkpointing on."""
    from lightning_avgpipe import AvgPipeTuner
    from lightning_avgpipe.tuning.model import checkpointed
    from lightning_avgpipe.tuning.search import NoFeasibleSettingError, search

    probe = AvgPipeTuner(apply=False, num_pipelines=1, num_microbatches=[2], output_dir=str(tmp_path / "t0"))
    _auto_fit(tmp_path / "probe", None, probe)
    assert probe.profile is not None
    plain = max(search(probe.profile, [2], 1).choice.peak_bytes)  # type: ignore[union-attr]
    saved = max(search(checkpointed(probe.profile, [6]), [2], 1).choice.peak_bytes)  # type: ignore[union-attr]
    assert saved < plain
    limit = (plain + saved) / 2
    with pytest.raises(NoFeasibleSettingError):
        search(probe.profile, [2], 1, memory_limit=limit)
    tuner = AvgPipeTuner(num_pipelines=1, num_microbatches=[2], memory_limit=limit, output_dir=str(tmp_path / "t1"))
    strategy, _ = _auto_fit(tmp_path / "tuned", limit, tuner)
    assert tuner.table is not None and tuner.table.notes["activation_checkpointing"] is True
    assert strategy.pipeline.recompute == [True] * 6
