"""The tuner's model of sharding over the D groups (tuning/sharding.py, tuning/recommend.py): per-rank bytes of each
level from the profile's numbers, the collectives' ordering, the lightest level that fits, whatif's table. No
processes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lightning_avgpipe.__main__ import main
from lightning_avgpipe.tuning import PipelineProfile, predict, search
from lightning_avgpipe.tuning.model import Prediction
from lightning_avgpipe.tuning.recommend import recommend
from tests.helpers.tuning import profile

MiB = 2**20
D, M = 4, 4
W, LAYER, ACT = 64 * MiB, 16 * MiB, 2 * MiB


def sharded_profile(**kw: object) -> PipelineProfile:
    """Two equal stages of W bytes (Adam: 2W of state), largest layer W/4, D = 4 groups, a measured all-reduce."""
    prof = profile(2, params=W, act=ACT)
    for st in prof.stages:
        st.layer_bytes = LAYER
    return dataclasses.replace(prof, num_groups=D, reference_allreduce_s=8e-3, **kw)


def test_per_rank_bytes_of_each_level_follow_the_formulas() -> None:
    prof = sharded_profile()
    st = prof.stages[0]
    w, o, layer = st.param_bytes, st.optimizer_state_bytes, st.layer_bytes
    assert o == 2 * w
    stash = predict(prof, M, 1, averaging="exact").peak_bytes[0] - (2 * w + o)  # NO_SHARD: activations on top
    assert stash > 0
    expected = {  # (level, reduce): (between steps, within a step besides the activations)
        ("NO_SHARD", "per_microbatch"): (2 * w + o, 2 * w + o),
        ("SHARD_OPTIM", "per_microbatch"): (2 * w + o / D, 2 * w + o / D),
        ("SHARD_GRAD_OP", "per_microbatch"): ((2 * w + o) / D, (2 * w + o) / D + w + layer),
        ("FULL_SHARD", "per_microbatch"): ((2 * w + o) / D, (2 * w + o) / D + layer + layer),
        ("SHARD_GRAD_OP", "per_step"): ((2 * w + o) / D, (2 * w + o) / D + w + w),
        ("FULL_SHARD", "per_step"): ((2 * w + o) / D, (2 * w + o) / D + w + w),
    }
    for (level, reduce), (rest, step) in expected.items():
        p = predict(prof, M, 1, averaging="exact", sharding=level, reduce_gradients=reduce)
        assert (p.sharding, p.reduce_gradients) == (level, reduce)
        assert p.rest_bytes == pytest.approx((rest, rest)), (level, reduce)
        assert p.peak_bytes[0] == pytest.approx(step + stash), (level, reduce)
    # Adam at D = 4: ZeRO-1 keeps 2.5 W, ZeRO-2/3 1 W between steps (of NO_SHARD's 4 W)
    assert expected[("SHARD_OPTIM", "per_microbatch")][0] == 2.5 * w
    # a schedule that defers the weight gradients reduces once, as per_step does; FULL_SHARD still gathers per use
    split = sharded_profile()
    for s in split.stages:
        s.input_grad_s, s.weight_grad_s = dict(s.backward_s), {b: v / 2 for b, v in s.backward_s.items()}
    zb = {
        level: predict(split, M, 1, "zbh1", averaging="exact", sharding=level).peak_bytes[0]
        - predict(split, M, 1, "zbh1", averaging="exact").peak_bytes[0]
        + (2 * w + o)
        for level in ("SHARD_GRAD_OP", "FULL_SHARD")
    }
    assert zb["SHARD_GRAD_OP"] == pytest.approx((2 * w + o) / D + w + w)
    assert zb["FULL_SHARD"] == pytest.approx((2 * w + o) / D + layer + w)


def test_old_profiles_read_as_before() -> None:
    """A profile written before the sharding fields: NO_SHARD, or SHARD_OPTIM with shard_optimizer_state."""
    data = sharded_profile().to_dict()
    for key in ("sharding_strategy", "reduce_gradients"):
        data.pop(key)
    for st in data["stages"]:
        st.pop("layer_bytes")
    old = PipelineProfile.from_dict(data)
    assert old.sharding == "NO_SHARD" and old.stages[0].layer_bytes == 0.0
    zero1 = PipelineProfile.from_dict({**data, "shard_optimizer_state": True})
    assert zero1.sharding == "SHARD_OPTIM"
    w = W
    assert predict(zero1, M, 1, averaging="exact").rest_bytes[0] == 2 * w + 2 * w / D
    # without a layer's size, FULL_SHARD's gathered layer counts as the whole stage (an upper bound)
    full = predict(old, M, 1, averaging="exact", sharding="FULL_SHARD")
    assert full.peak_bytes[0] - full.rest_bytes[0] == pytest.approx(
        predict(old, M, 1, averaging="exact", sharding="SHARD_GRAD_OP").peak_bytes[0] - full.rest_bytes[0]
    )
    assert json.loads(json.dumps(predict(old, M, 1, averaging="exact").to_dict()))["rest_bytes"] == [4 * w, 4 * w]


def test_traffic_orders_the_levels_and_reduce_modes() -> None:
    prof = sharded_profile()
    half = prof.reference_allreduce_s / 2  # an all-gather (or reduce-scatter) of a stage's weights
    wire = (D - 1) / D * W

    def run(level: str, reduce: str = "per_microbatch", m: int = M) -> Prediction:
        return predict(prof, m, 1, averaging="exact", sharding=level, reduce_gradients=reduce)

    gathers = {  # per step, in all-gathers of the stage's weights
        ("NO_SHARD", "per_microbatch"): 2,
        ("SHARD_OPTIM", "per_microbatch"): 3,
        ("SHARD_GRAD_OP", "per_microbatch"): 1 + M,
        ("FULL_SHARD", "per_microbatch"): 2 * M + M,
        ("SHARD_GRAD_OP", "per_step"): 2,
        ("FULL_SHARD", "per_step"): 2,
    }
    for (level, reduce), n in gathers.items():
        p = run(level, reduce)
        assert p.traffic_bytes == pytest.approx(n * wire), (level, reduce)
        assert p.traffic_s == pytest.approx(n * half), (level, reduce)
    for level in ("SHARD_GRAD_OP", "FULL_SHARD"):
        per_step, per_mb = run(level, "per_step"), run(level, "per_microbatch")
        assert per_step.traffic_bytes < per_mb.traffic_bytes
        assert per_step.step_time < per_mb.step_time
    # one micro-batch: ZeRO-2 runs the same collectives either way (ZeRO-3 per micro-batch gathers twice)
    assert run("SHARD_GRAD_OP", "per_step", 1).traffic_bytes == run("SHARD_GRAD_OP", "per_microbatch", 1).traffic_bytes
    times = [run(level).step_time for level in ("NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD")]
    assert times == sorted(times)
    # ZeRO-2/3 shard one model: refused under elastic averaging of several replicas
    with pytest.raises(ValueError, match="averaging='exact'"):
        predict(prof, M, 1, sharding="FULL_SHARD")
    # D = 1: nothing is sharded
    one = dataclasses.replace(prof, num_groups=1)
    assert predict(one, M, 1, averaging="exact", sharding="FULL_SHARD").peak_bytes == predict(one, M, 1).peak_bytes


def test_a_profile_taken_under_zero3_does_not_count_its_collectives_twice() -> None:
    plain = sharded_profile()
    measured = sharded_profile(sharding_strategy="FULL_SHARD")
    half = plain.reference_allreduce_s / 2
    for st in measured.stages:  # its units ran their all-gathers (forward, backward) and reduce-scatter
        st.forward_s = {b: v + half for b, v in st.forward_s.items()}
        st.backward_s = {b: v + 2 * half for b, v in st.backward_s.items()}
    for level in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"):
        a = predict(plain, M, 1, averaging="exact", sharding=level)
        b = predict(measured, M, 1, averaging="exact", sharding=level)
        assert b.step_time == pytest.approx(a.step_time), level


def _peak(level: str, reduce: str = "per_microbatch") -> float:
    """The least peak any setting needs under ``level`` (N = 1, every M)."""
    table = search(sharded_profile(), num_pipelines=[1], averaging=["exact"], sharding=level, reduce_gradients=reduce)
    return min(max(r.peak_bytes) for r in table.rows)


def test_the_lightest_level_that_fits_is_recommended() -> None:
    prof = sharded_profile()
    needs = {level: _peak(level) for level in ("NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD")}
    assert needs["NO_SHARD"] > needs["SHARD_OPTIM"] > needs["SHARD_GRAD_OP"] > needs["FULL_SHARD"]
    args = {"num_pipelines": [1], "averaging": ["exact", "elastic"], "objective": "throughput"}
    for level in ("NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD"):
        advice = recommend(prof, {**args, "memory_limit": needs[level] * 1.001})
        assert advice is not None
        assert advice["choice"]["sharding"] == level, (level, advice["line"])
        assert f"sharding_strategy='{level}'" in advice["line"]
        assert ("Not applied: it rebuilds the model" in advice["line"]) == (level != "NO_SHARD")
        tried = [r["sharding"] for r in advice["rows"]]
        assert tried[-1] == level and all(not r["fits"] for r in advice["rows"] if r["sharding"] != level)
    # both reduce modes fit at ZeRO-2's per_step need: the faster (per_step, M > 1) is taken
    advice = recommend(prof, {**args, "memory_limit": _peak("SHARD_GRAD_OP", "per_step") * 1.001})
    assert advice is not None and advice["choice"]["sharding"] == "SHARD_OPTIM"
    roomy = max(needs["SHARD_OPTIM"], _peak("SHARD_GRAD_OP", "per_step")) * 1.001
    only_fsdp = dataclasses.replace(prof, shard_optimizer_state=False)
    advice = recommend(only_fsdp, {**args, "averaging": ["exact"], "memory_limit": roomy})
    assert advice is not None
    advice = recommend(only_fsdp, {**args, "averaging": ["exact"], "memory_limit": needs["SHARD_GRAD_OP"] * 1.001})
    assert advice is not None and advice["choice"]["reduce_gradients"] == "per_microbatch"
    # nothing fits; elastic averaging weighs ZeRO-1 at most; D = 1 or no limit: no advice
    advice = recommend(prof, {**args, "memory_limit": needs["FULL_SHARD"] * 0.5})
    assert advice is not None and advice["choice"] is None and advice["line"].startswith("sharding: no level fits")
    elastic = recommend(prof, {**args, "averaging": ["elastic"], "memory_limit": needs["FULL_SHARD"] * 1.001})
    assert elastic is not None and [r["sharding"] for r in elastic["rows"]] == ["NO_SHARD", "SHARD_OPTIM"]
    assert recommend(dataclasses.replace(prof, num_groups=1), {**args, "memory_limit": 1.0}) is None
    assert recommend(prof, {**args, "memory_limit": None}) is None


def test_per_step_is_named_where_the_strategys_zero2_has_room() -> None:
    """per_step holds more within a step than ZeRO-1, so it is never the lightest; at the strategy's own ZeRO-2 (or
    ZeRO-3) it is named where it fits and runs faster (M > 1: one reduce-scatter instead of M)."""
    assert _peak("SHARD_GRAD_OP", "per_step") > _peak("SHARD_OPTIM")
    zero2 = sharded_profile(sharding_strategy="SHARD_GRAD_OP")
    kw = {"num_pipelines": [1], "num_microbatches": [M], "objective": "throughput", "averaging": ["exact"]}

    def need(reduce: str) -> float:
        return max(predict(zero2, M, 1, averaging="exact", reduce_gradients=reduce).peak_bytes) * 1.001

    roomy = recommend(zero2, {**kw, "memory_limit": need("per_step")})
    assert roomy is not None and roomy["reduce"] is not None
    assert roomy["reduce"]["reduce_gradients"] == "per_step"
    assert "At the strategy's SHARD_GRAD_OP, reduce_gradients='per_step' fits and predicts" in roomy["line"]
    tight = recommend(zero2, {**kw, "memory_limit": need("per_microbatch")})
    assert tight is not None and tight["reduce"] is None
    assert (tight["choice"]["sharding"], tight["choice"]["reduce_gradients"]) == ("SHARD_GRAD_OP", "per_microbatch")
    assert "the profiled level" in tight["line"]


def test_whatif_prints_every_level(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = search(sharded_profile(), num_pipelines=1).write_json(tmp_path / "tuning.json")
    base = ["whatif", "--profile", str(path), "--stages", "2", "--groups", "4", "--num-pipelines", "1"]
    assert main([*base, "--num-microbatches", "4", "--sharding", "all"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("sharding at M = ") :].splitlines()
    assert table[1].split()[:4] == ["level", "reduce", "rest", "MiB"]
    assert [line.split()[:2] for line in table[2:8]] == [
        ["NO_SHARD", "-"],
        ["SHARD_OPTIM", "-"],
        ["SHARD_GRAD_OP", "per_microbatch"],
        ["SHARD_GRAD_OP", "per_step"],
        ["FULL_SHARD", "per_microbatch"],
        ["FULL_SHARD", "per_step"],
    ]
    rest = [float(line.split()[2]) for line in table[2:8]]
    assert rest == [256.0, 160.0, 64.0, 64.0, 64.0, 64.0]
    # 120 MiB: nothing fits as profiled (NO_SHARD, elastic); the lightest level that fits is named
    assert main([*base, "--num-microbatches", "4", "--sharding", "all", "--memory-limit-mb", "120"]) == 1
    out = capsys.readouterr().out
    assert "sharding_strategy='FULL_SHARD', reduce_gradients='per_microbatch' is the lightest that fits" in out
    assert main([*base, "--sharding", "FULL_SHARD", "--reduce-gradients", "per_step"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("sharding=FULL_SHARD")


def test_the_levels_are_the_configs() -> None:
    from lightning_avgpipe import config
    from lightning_avgpipe.tuning import sharding

    assert (sharding.LEVELS, sharding.REDUCE) == (config.LEVELS, config.REDUCE)
    for name in ("zero0", "zero1", "Zero-2", "ZERO3", "full_shard"):
        assert sharding.check(name, "per_step")[0] == config.level_of(name)
