"""AvgPipeTuner(retune_every_n_steps=K): the re-decision, the learning-rate rule, the errors, and a resumed run that
continues with the same decisions and weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_avgpipe import AvgPipeStrategy, AvgPipeTuner
from lightning_avgpipe.plugin.tuner import run as tune_module
from lightning_avgpipe.tuning.model import PipelineProfile
from lightning_avgpipe.tuning.retune import RetunePlan, check_retune, lr_exponent, lr_factor, scale_lr, setting_key
from lightning_avgpipe.tuning.search import search
from tests.helpers.equivalence import run_lightning
from tests.helpers.lit import PipeNet, loader, quiet_trainer
from tests.helpers.tuning import profile


# -- the pieces ------------------------------------------------------------------------------------------------------
def test_lr_rule_by_optimizer_family() -> None:
    w = [torch.nn.Parameter(torch.zeros(2))]
    assert lr_exponent(torch.optim.SGD(w, lr=0.1), "auto") == 1.0
    assert lr_exponent(torch.optim.AdamW(w, lr=0.1), "auto") == 0.5
    assert lr_exponent(torch.optim.Adam(w, lr=0.1), "auto") == 0.5
    assert lr_exponent(torch.optim.SGD(w, lr=0.1), "sqrt") == 0.5
    assert lr_exponent(torch.optim.Adam(w, lr=0.1), "none") == 0.0
    with pytest.raises(ValueError, match=r"does not know LBFGS: pass lr_scaling='sqrt', 'linear' or 'none'"):
        lr_exponent(torch.optim.LBFGS(w, lr=0.1), "auto")
    with pytest.raises(ValueError, match=r"lr_scaling='cubic' is not one of"):
        lr_exponent(torch.optim.SGD(w, lr=0.1), "cubic")
    p = profile(num_stages=2)  # B = 8, D = 1
    assert lr_factor(p, (2, 1, "exact"), (2, 4, "exact"), 1.0) == pytest.approx(4.0)
    assert lr_factor(p, (2, 1, "exact"), (2, 4, "exact"), 0.5) == pytest.approx(2.0)
    assert lr_factor(p, (2, 4, "exact"), (1, 2, "exact"), 0.5) == pytest.approx(0.5**0.5)


def test_scale_lr_scales_the_scheduler_base_too() -> None:
    w = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD(w, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()  # lr 0.05
    scale_lr(opt, 4.0, [sched])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    assert sched.base_lrs == [pytest.approx(0.4)]
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # the schedule continues from the scaled rates


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, r"retune_every_n_steps=0 must be an int >= 1"),
        ({"objective": "throughput"}, r"with objective='throughput'.*use objective='goodput'"),
        ({"averaging": "elastic"}, r"averaging='elastic': only exact averaging can change N"),
        ({"apply": False}, r"apply=False: a retune applies its decisions"),
    ],
)
def test_retune_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    args = {"every": 10, "objective": "goodput", "averaging": None, "apply": True, **kwargs}
    with pytest.raises(ValueError, match=match):
        check_retune(**args)
    tuner_args = {
        "retune_every_n_steps": args["every"],
        "objective": args["objective"],
        "averaging": args["averaging"],
        "apply": args["apply"],
    }
    with pytest.raises(ValueError, match=match):
        AvgPipeTuner(**tuner_args)
    with pytest.raises(ValueError, match=r"lr_scaling='x'"):
        AvgPipeTuner(retune_every_n_steps=5, lr_scaling="x")


def _plan(ms: tuple[int, ...] = (1, 2)) -> RetunePlan:
    prof = profile(num_stages=2, iteration_overhead_s=5e-3)  # a fixed cost per iteration: N > 1 has more samples/s
    table = search(prof, list(ms), [1, 2, 4], objective="goodput", averaging=["exact"])
    return RetunePlan(prof, table.notes["search_args"], setting_key(table.choice))


def test_the_decision_follows_the_noise_scale() -> None:
    plan = _plan(ms=(2,))
    small = plan.search(1.0)  # every sample counts: a larger batch wastes them
    assert small.choice.num_pipelines == 1
    big = plan.search(1e7)  # the noise dominates: the most samples/s wins
    assert big.choice.num_pipelines == 4 and big.choice.averaging == "exact"
    assert big.choice.goodput == max(r.goodput for r in big.rows)
    # measured times beat predictions: N = 1 ran as predicted, N = 4 10x slower than predicted: N = 4 loses
    n1 = max((r for r in big.rows if r.num_pipelines == 1), key=lambda r: r.goodput)
    plan.record(setting_key(big.choice), [big.choice.step_time * 10] * 3)
    plan.record(setting_key(n1), [n1.step_time] * 3)
    plan.current = setting_key(n1)  # the running setting's factor also scales the settings not measured
    assert plan.search(1e7).choice.num_pipelines != 4


def test_the_running_setting_is_kept_unless_another_pays_3_percent() -> None:
    best = _plan().search(1e7).choice
    for short, kept in ((1.02, True), (1.05, False)):
        plan = _plan()
        rows = plan.search(1e7).rows
        runner = max((r for r in rows if setting_key(r) != setting_key(best)), key=lambda r: r.goodput)
        plan.current = setting_key(runner)
        for r in rows:  # every other setting ran as predicted; the running one `short` below the best's goodput
            if setting_key(r) != plan.current:
                plan.record(setting_key(r), [r.step_time] * 3)
        plan.record(plan.current, [runner.step_time * runner.goodput * short / best.goodput] * 3)
        expected = plan.current if kept else setting_key(best)
        assert setting_key(plan.search(1e7).choice) == expected, short


def test_a_switch_needs_a_noise_reading_taken_since_the_last_decision() -> None:
    """A scripted sequence of (noise scale, measurements so far): each decision that saw new readings may switch;
    one that saw none keeps the running setting, whatever the value says (no flip-flop on a stale reading)."""
    plan = _plan(ms=(2,))
    decided = []
    for value, count in ((1e7, 3), (1.0, 5), (1e7, 5), (1e7, 6)):
        table = plan.search(value, count)
        assert table.choice is not None
        plan.current = setting_key(table.choice)
        decided.append((plan.current[1], "no noise measurement since the last decision" in table.notes["reason"]))
    assert decided == [(4, False), (1, False), (1, True), (4, False)]
    assert plan.noise_seen == 6 and RetunePlan.from_dict(json.loads(json.dumps(plan.to_dict()))).noise_seen == 6


def test_the_plan_round_trips_through_json() -> None:
    plan = _plan()
    plan.record(plan.current, [0.01, 0.012, 0.011])
    plan.decisions.append({"step": 3, "to": list(plan.current)})
    again = RetunePlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.current == plan.current and again.measured == plan.measured and again.predicted == plan.predicted
    assert again.search(50.0).rows == plan.search(50.0).rows
    assert again.decisions == plan.decisions


# -- in a Lightning fit (one process, one stage) ----------------------------------------------------------------------
class ForceNoise(pl.Callback):
    """Set the live noise scale at chosen epoch starts (before the tuner's hook), so decisions are known."""

    def __init__(self, values: dict[int, float]) -> None:
        self.values = values

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = self.values.get(trainer.current_epoch)
        if value is not None:
            # a reading newer than the last decision's (a retune switches only on one)
            count = 5 + 10 * trainer.current_epoch
            state = {"decay": 0.9, "grad_sq": 1.0, "trace": float(value), "weight": 1.0, "measurements": count}
            trainer.strategy.controller.noise_scale.load_state_dict(state)  # type: ignore[attr-defined]


def _fit(
    root: Path,
    epochs: int,
    ckpt_path: str | None = None,
    optimizer: str = "adam",
    retune: int | None = 1,
    **trainer_kwargs: Any,
) -> tuple[pl.Trainer, AvgPipeTuner, PipeNet]:
    torch.manual_seed(0)
    tuner = AvgPipeTuner(
        num_pipelines=[1, 4],
        num_microbatches=[2],
        retune_every_n_steps=retune,
        calibrate_steps=0,
        output_dir=str(root / "tuning"),
    )
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = quiet_trainer(
        root,
        max_epochs=epochs,
        strategy=AvgPipeStrategy(num_microbatches=2),
        callbacks=[ForceNoise({1: 1e-3, 2: 1e7}), tuner, checkpoints],
        limit_val_batches=0,
        **trainer_kwargs,
    )
    model = PipeNet(optimizer=optimizer, lr=0.01)
    with mock.patch.object(tune_module, "profile_pipeline", recorded_profile):
        trainer.fit(model, loader(12, 96), ckpt_path=ckpt_path)
    return trainer, tuner, model


def recorded_profile(*args: Any, **kwargs: Any) -> PipelineProfile:
    """The profile the first decision is made from, recorded once: a profile measured here would depend on the
    machine's load (a loaded one can choose N = 4 where a quiet one chooses N = 1); the test checks the decisions."""
    return PipelineProfile.from_dict(json.loads(PROFILE.read_text()))


PROFILE = Path(__file__).parent / "helpers" / "retune_profile.json"


@pytest.mark.timeout(300)
def test_a_retune_changes_n_scales_the_lr_keeps_the_optimizer_and_resumes_exactly(tmp_path: Path) -> None:
    trainer, tuner, model = _fit(tmp_path / "a", epochs=4)
    moves = [(d["epoch"], d["from"][1], d["to"][1]) for d in tuner.decisions]
    # epoch 1: tiny noise keeps N = 1; epoch 2: the noise dominates and N = 4 (exact) pays; epoch 3 keeps it
    assert moves[1:] == [(1, 1, 1), (2, 1, 4), (3, 4, 4)], tuner.decisions
    assert trainer.strategy.config.num_pipelines == 4 and trainer.strategy.config.averaging == "exact"
    optimizer = trainer.optimizers[0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02)  # Adam: sqrt(4) x 0.01
    assert optimizer.state  # the moments carried over (exact averaging keeps one model and its optimizer)
    # 8 iterations in epochs 0 and 1, 2 in epochs 2 and 3 (an iteration takes 4 batches of 12)
    assert trainer.global_step == 8 + 8 + 2 + 2
    report = json.loads((tmp_path / "a" / "tuning" / "tuning.json").read_text())
    assert [d["to"] for d in report["notes"]["retunes"]] == [d["to"] for d in tuner.decisions]

    # resumed from the end of epoch 1 (N = 1): the checkpoint's setting, then the same decision at epoch 2
    resumed, tuner_b, model_b = _fit(tmp_path / "b", epochs=4, ckpt_path=str(tmp_path / "a" / "ckpt" / "epoch=1.ckpt"))
    assert [(d["epoch"], d["to"][1]) for d in tuner_b.decisions] == [(d["epoch"], d["to"][1]) for d in tuner.decisions]
    assert resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02)
    for (name, a), b in zip(model.state_dict().items(), model_b.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

    # resumed from the end of epoch 2 (N = 4 applied there): N = 4 and its lr come back before training continues
    again, tuner_c, model_c = _fit(tmp_path / "c", epochs=4, ckpt_path=str(tmp_path / "a" / "ckpt" / "epoch=2.ckpt"))
    assert tuner_c.decisions[2]["to"][1] == 4 and again.global_step == trainer.global_step
    for (name, a), b in zip(model.state_dict().items(), model_c.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.timeout(120)
def test_retune_refuses_gradient_accumulation_and_elastic_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2: the noise .* use accumulate_grad_batches=1"):
        _fit(tmp_path / "acc", epochs=1, accumulate_grad_batches=2)
    tuner = AvgPipeTuner(retune_every_n_steps=4, num_pipelines=[1, 2], calibrate_steps=0)
    strategy = AvgPipeStrategy(num_microbatches=2, averaging_period=4)
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=False, strategy=strategy, callbacks=[tuner])
    with pytest.raises(ValueError, match=r"\{'averaging_period': 4\} \(options of elastic averaging\)"):
        trainer.fit(PipeNet(), loader())
    tuner = AvgPipeTuner(retune_every_n_steps=4, num_pipelines=[1, 2], calibrate_steps=0)
    strategy = AvgPipeStrategy(num_microbatches=2, schedule="zbh1")  # no unit's gradients whole: no noise reading
    trainer = quiet_trainer(tmp_path, max_epochs=1, enable_checkpointing=False, strategy=strategy, callbacks=[tuner])
    with pytest.raises(ValueError, match=r"schedule='zbh1': the noise scale .* Use schedule='1f1b'"):
        trainer.fit(PipeNet(), loader())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_stages_take_the_same_decisions(tmp_path: Path) -> None:
    """Every rank decides from rank 0's timings and the all-reduced noise scale: the stages never disagree on N."""
    results = run_lightning(
        tmp_path,
        2,
        {"num_microbatches": 2, "partition": [3, 3]},
        steps=10,
        trainer={"max_epochs": 10},
        tuner={
            "num_pipelines": [1, 2],
            "num_microbatches": [2],
            "retune_every_n_steps": 2,
            "calibrate_steps": 0,
            "output_dir": str(tmp_path / "tuning"),
        },
    )
    a, b = (r["tuner"]["decisions"] for r in results)
    assert len(a) >= 3 and a == b
    assert any(d["noise_measurements"] > 0 for d in a[1:]), a  # measured in training (every 4th step here)
    assert results[0]["setting"] == results[1]["setting"] == [2, a[-1]["to"][1]]
    assert len(results[0]["losses"]) == 10


@pytest.mark.timeout(120)
def test_a_checkpoint_without_retune_state_is_said_and_not_retuned(tmp_path: Path) -> None:
    _fit(tmp_path / "plain", epochs=1, retune=None)
    with pytest.warns(UserWarning, match=r"the checkpoint holds no retune state .* does not retune"):
        trainer, tuner, _ = _fit(
            tmp_path / "resumed", epochs=2, ckpt_path=str(tmp_path / "plain" / "ckpt" / "epoch=0.ckpt")
        )
    assert tuner.decisions == [] and trainer.current_epoch == 2
