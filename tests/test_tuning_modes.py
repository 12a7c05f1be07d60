"""Tensor parallelism's modes in the tuner (issue 45, part 5): ``tuning/tensor_modes.py``, ``whatif.project`` and
the ``whatif`` command's side-by-side table. The toy stage: W = 6 MiB of weights (4 MiB of them the MLP's, at
``WIDENING`` 4), one unit saving 8 MiB, a boundary activation A = 1 MiB, one transformer block (2 split pairs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_avgpipe.__main__ import main
from lightning_avgpipe.tuning.search import search
from lightning_avgpipe.tuning.tensor_modes import Mode, Traffic, compare, layouts
from lightning_avgpipe.tuning.whatif import TensorParallel, project
from tests.helpers.tuning import profile

MIB = 2.0**20
W, ACT, A = 6 * MIB, 8 * MIB, 1 * MIB


def test_layouts_follow_the_strategys_rule_for_t() -> None:
    assert layouts(2) == [("1d", 1, 0)]
    assert layouts(8) == [("1d", 1, 0), ("2.5d", 2, 2)]
    assert layouts(16) == [("1d", 1, 0), ("2d", 1, 4), ("2.5d", 4, 2)]
    assert layouts(36) == [("1d", 1, 0), ("2d", 1, 6), ("2.5d", 4, 3), ("2.5d", 9, 2)]


def test_each_mode_holds_its_share_of_weights_and_activations() -> None:
    one, sp = Mode(16, fraction=0.75), Mode(16, sequence_parallel=True, fraction=0.75)
    grid, deep = Mode(16, "2d", fraction=0.75), Mode(16, "2.5d", 4, fraction=0.75, attention=0.5)
    assert one.weights() == sp.weights() == pytest.approx(0.25 + 0.75 / 16)
    assert one.activations() == pytest.approx(0.25 + 0.75 / 16)
    assert sp.activations() == pytest.approx(1 / 16)  # everything between the split matmuls on 1/T of the sequence
    assert grid.q == 4 and grid.weights() == pytest.approx(0.25 + 0.75 / 16) and grid.activations() == 1 / 16
    assert deep.q == 2 and deep.weights() == pytest.approx(0.25 + 0.75 / 4)  # 1/q²: copied over d
    assert deep.activations() == pytest.approx(0.5 / 4 + 0.5 / 16)  # the attention at 1/q², the rest 1/(d q²)
    assert (one.boundary(), sp.boundary(), grid.boundary()) == (1.0, 1 / 16, 1 / 16)
    # heads that T = d q² divides are split over all 16 ranks, as the grid splits them; others over q² = 4
    assert Mode(16, "2.5d", 4, heads=32).activations() == pytest.approx(0.5 / 16 + 0.5 / 16)
    assert Mode(16, "2.5d", 4, heads=12).activations() == deep.activations()
    assert Mode(16, "2d", heads=12).activations() == grid.activations() == 1 / 16  # q² = T: heads change nothing


def test_traffic_per_unit_of_each_mode_on_the_toy_stage() -> None:
    f, b = Mode(16).traffic(A, W, 2)  # two all-reduces of A over 16 ranks each way
    assert f == b == Traffic(2 * 2 * 15 / 16 * A, 60)
    f, b = Mode(16, sequence_parallel=True).traffic(A, W, 2)
    # MLP: gather + scatter (backward: 3 gathers); attention: gather + all-reduce; the stage's edge: one gather
    assert f == Traffic((4 * 15 + 30) / 16 * A, 4 * 15 + 30)
    assert b == Traffic((5 * 15 + 30) / 16 * A, 5 * 15 + 30)
    f, b = Mode(16, "2d").traffic(A, W, 2)
    # SUMMA: (A + 4A)/q of activation blocks and 4 MiB/q of weight blocks in 2 x 2q broadcasts; attention: gather
    # over 16, all-reduce over q² = 16; two norms x two statistics along the row of 4 (latency only); edge
    summa = 5 * A / 4 + 4 * MIB / 4
    assert f.nbytes == pytest.approx(summa + 15 / 16 * A + 30 / 16 * A + 15 / 16 * A)  # 6 A
    assert f.nbytes == pytest.approx(6 * A) and f.messages == 16 + 45 + 24 + 15
    assert b.nbytes == pytest.approx(2 * summa + 2 * 15 / 16 * A + 30 / 16 * A + 15 / 16 * A)
    assert b.messages == 32 + 60 + 24 + 15
    deep = Mode(16, "2.5d", 4)
    f, _ = deep.traffic(A, W, 2)
    assert f.nbytes == pytest.approx(5 * A / 8 + 4 * MIB / 2 + 15 / 16 * A + 1.5 * A + 15 / 16 * A)
    assert f.messages == 8 + 21 + 8 + 15
    assert deep.step_traffic(W) == Traffic(2 * 3 / 4 * MIB, 6)  # the MLP's 1 MiB block summed over d = 4
    f, _ = Mode(16, "2.5d", 4, heads=16).traffic(A, W, 2)  # the attention's all-reduce over all 16 ranks, not 4
    assert f.nbytes == pytest.approx(5 * A / 8 + 4 * MIB / 2 + 15 / 16 * A + 30 / 16 * A + 15 / 16 * A)
    assert f.messages == 8 + 15 + 30 + 8 + 15
    assert Mode(16, "2d").step_traffic(W) == Traffic() and Mode(1).traffic(A, W, 2) == (Traffic(), Traffic())
    assert Traffic(1e9, 3).seconds(1e-3, 1e9) == pytest.approx(1.003)


def test_compare_lists_every_mode_that_fits_t() -> None:
    rows = compare(16, W, ACT, A, 2, latency_s=1e-5, bandwidth=1e11)
    assert [r.label for r in rows] == ["1d", "1d+sp", "2d q=4", "2.5d d=4 q=2"]
    assert [r.weights / MIB for r in rows] == pytest.approx([6 / 16, 6 / 16, 6 / 16, 6 / 4])
    assert [r.activations / MIB for r in rows] == pytest.approx([0.5, 0.5, 0.5, 8 * (0.5 / 4 + 0.5 / 16)])
    two = rows[2]
    assert two.unit_s == pytest.approx(two.unit.nbytes / 1e11 + two.unit.messages * 1e-5)
    assert [r.step.nbytes for r in rows] == [0, 0, 0, pytest.approx(1.5 * MIB)]


def test_project_under_2d_and_25d_holds_and_moves_the_modes_share() -> None:
    prof = profile()
    plain = project(prof, 4)
    lat, bw = 1e-5, 1e11
    st, b = plain.stages[1], 2.0
    grid = project(prof, 4, tensor=TensorParallel(16, 1.0, 8, lat, bw, mode="2d")).stages[1]
    a, w = st.sent(b), st.param_bytes
    fwd = (5 * a / 4 + w * 2 / 3 / 4 + 60 / 16 * a) / bw + 100 * lat  # as the toy's 2d forward: P = 8 / 4 = 2
    assert grid.forward(b) == pytest.approx(st.forward(b) / 16 + fwd)
    assert grid.activations(b) == pytest.approx(st.activations(b) / 16)
    assert grid.param_bytes == pytest.approx(w / 16) and grid.optimizer_state_bytes == pytest.approx(
        st.optimizer_state_bytes / 16
    )
    deep = project(prof, 4, tensor=TensorParallel(16, 1.0, 8, lat, bw, mode="2.5d", depth=4, attention=0.25)).stages[1]
    assert deep.param_bytes == pytest.approx(w / 4)
    assert deep.activations(b) == pytest.approx(st.activations(b) * (0.25 / 4 + 0.75 / 16))
    summed = 2 * 3 / 4 * (w * 2 / 3 / 4) / bw + 6 * lat  # the SUMMA weights' block all-reduced over d = 4
    assert deep.optimizer_step_s == pytest.approx(st.optimizer_step_s / 4 + summed)
    # sequence parallelism with checkpointing: a layer's input is kept as its 1/T part
    sp = project(prof, 4, tensor=TensorParallel(4, allreduces=8, sequence_parallel=True), checkpointed_layers=8)
    assert sp.stages[1].activations(b) == pytest.approx(2 * st.sent(b) / 4)


def test_tensor_parallel_refuses_a_mode_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8: use one of \[4, 9, 16, 25, 36\].*2.5d d=2"):
        TensorParallel(8, mode="2d")
    with pytest.raises(ValueError, match="tensor_parallel_depth=2 with tensor_parallel_mode='2d'"):
        TensorParallel(16, mode="2d", depth=2)
    with pytest.raises(ValueError, match="sequence_parallel=True with tensor_parallel_mode='2d'"):
        TensorParallel(16, mode="2d", sequence_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_mode='3d' is not one of"):
        TensorParallel(4, mode="3d")
    with pytest.raises(ValueError, match="attention_share=1.5"):
        TensorParallel(4, attention=1.5)
    with pytest.raises(ValueError, match=r"attention_heads=-2 must be an int >= 0 \(0: not known\)"):
        TensorParallel(4, heads=-2)


def _peak(out: str) -> float:
    choice = next(line for line in out.splitlines() if line.startswith("choice:"))
    return float(choice.split("peak ")[1].split(" MiB")[0])


def test_whatif_prints_the_modes_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = search(profile(), num_pipelines=2).write_json(tmp_path / "tuning.json")
    args = ["whatif", "--profile", str(path), "--stages", "4", "--num-pipelines", "1", "--num-microbatches", "2"]
    tp = ["--tensor-parallel-size", "16", "--tensor-allreduces", "8", "--tensor-fraction", "0.8"]
    assert main([*args, *tp, "--tensor-parallel-mode", "2d"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("what-if: 4 profiled stage(s) -> S=4, D=1, T=16 (2d q=4), B=8")
    at = next(i for i, line in enumerate(out) if line.startswith("tensor modes at T=16"))
    assert "micro-batch size 4" in out[at]
    rows = {line[2:16].strip(): line[16:].split() for line in out[at + 2 : at + 6]}
    assert list(rows) == ["1d", "1d+sp", "2d q=4", "2.5d d=4 q=2"]
    st = project(profile(), 4).stages[0]
    w, act = st.param_bytes / MIB, st.activations(4.0) / MIB
    assert rows["1d"][:2] == [f"{w * 0.25:.3f}", f"{act * 0.25:.3f}"]
    assert rows["1d+sp"][:2] == [f"{w * 0.25:.3f}", f"{act / 16:.3f}"]
    assert rows["2d q=4"][:2] == [f"{w * 0.25:.3f}", f"{act / 16:.3f}"]
    assert rows["2.5d d=4 q=2"][:2] == [f"{w * 0.4:.3f}", f"{act * (0.5 / 4 + 0.5 / 16):.3f}"]
    step = 1.5 * 0.8 * st.param_bytes * 2 / 3 / 4 / MIB  # the SUMMA weights' 1/q² all-reduced over d = 4
    assert " ".join(rows["2.5d d=4 q=2"][4:]) == f"+ {step:.3f} MiB per step over d"
    assert all(len(rows[k]) == 4 for k in ("1d", "1d+sp", "2d q=4"))
    assert main([*args, *tp, "--attention-heads", "16"]) == 0  # 16 heads: 2.5d splits them over all T
    heads = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(heads) if line.startswith("tensor modes at T=16"))
    deep = next(line[16:].split() for line in heads[at + 2 : at + 6] if line[2:16].strip() == "2.5d d=4 q=2")
    assert deep[:2] == [f"{w * 0.4:.3f}", f"{act / 16:.3f}"]
    # the search ran on the 2d projection: its peak holds 1/16 of the stash where 1d holds 1/4 of it
    assert main([*args, *tp]) == 0
    peak_1d = _peak(capsys.readouterr().out)
    assert _peak("\n".join(out)) < peak_1d
    assert main([*args, "--tensor-parallel-size", "2"]) == 0
    two = capsys.readouterr().out
    assert "no 2D layout: T=2 is not d x q x q" in two and "1d+sp" in two and "2d q=" not in two
    assert main(args) == 0
    assert "tensor modes" not in capsys.readouterr().out  # T = 1: nothing to compare


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--tensor-parallel-size", "8", "--tensor-parallel-mode", "2d"], "--tensor-parallel-mode '2d' with"),
        (["--tensor-parallel-size", "8", "--tensor-parallel-mode", "2d"], "--tensor-parallel-size 8: use one of [4, 9"),
        (["--tensor-parallel-size", "16", "--tensor-parallel-mode", "2.5d"], "--tensor-parallel-depth 1 with"),
        (
            ["--tensor-parallel-size", "16", "--tensor-parallel-mode", "2d", "--sequence-parallel"],
            "--sequence-parallel",
        ),
        (["--sequence-parallel"], "--tensor-parallel-size 1: it cuts the sequence under '1d' with T > 1"),
        (["--tensor-parallel-size", "4", "--attention-share", "2"], "--attention-share 2.0 must be in [0, 1]"),
        (["--tensor-parallel-size", "4", "--attention-heads", "-1"], "--attention-heads -1 must be an int >= 0"),
    ],
)
def test_whatif_refuses_a_mode_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    path = search(profile(), num_pipelines=2).write_json(tmp_path / "tuning.json")
    with pytest.raises(SystemExit) as e:
        main(["whatif", "--profile", str(path), "--stages", "4", *extra])
    assert e.value.code == 2 and says in capsys.readouterr().err
