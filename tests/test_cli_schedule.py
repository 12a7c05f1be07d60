"""Pure units for the ``schedule`` command of ``python -m lightning_avgpipe`` (run in-process through ``main``)."""

from __future__ import annotations

import re

import pytest

from lightning_avgpipe.__main__ import main


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, list[str]]:
    assert main(["schedule", *args]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    return lines[0], lines


def _rows(lines: list[str]) -> dict[int, list[str]]:
    rows = {}
    for line in lines:
        match = re.match(r"^stage (\d+) \| (.*)$", line)
        if match:
            rows[int(match.group(1))] = match.group(2).split()
    return rows


def test_1f1b_table(capsys: pytest.CaptureFixture[str]) -> None:
    summary, lines = _run(capsys, "--stages", "4", "--microbatches", "8", "--schedule", "1f1b")
    assert summary == (
        "schedule=1f1b stages=4 units=8 advance_forwards=0: step time 33, bubble 27.3%, "
        "peak stash per stage [4, 3, 2, 1]"
    )  # bubble (S-1)/(M+S-1) = 3/11, step (M+S-1)(f+b) = 11 * 3
    assert lines[1].startswith("time    | 0")
    rows = _rows(lines)
    assert sorted(rows) == [0, 1, 2, 3]
    assert len(lines) == 1 + 1 + 4  # summary, time axis, one row per stage
    for cells in rows.values():
        assert len(cells) == 33  # one column per time unit
        assert cells.count(".") == 33 - 8 * 3  # idle slots: the bubble
        for u in range(8):
            assert cells.count(f"F{u}") == 1 and cells.count(f"B{u}") == 2
    assert rows[3][:4] == [".", ".", ".", "F0"]
    assert rows[0][:5] == ["F0", "F1", "F2", "F3", "."]


def test_advance_forwards(capsys: pytest.CaptureFixture[str]) -> None:
    summary, lines = _run(
        capsys, "--stages", "4", "--microbatches", "8", "--schedule", "advance", "--advance-forwards", "2"
    )
    assert summary.startswith("schedule=advance stages=4 units=8 advance_forwards=2:")
    assert "peak stash per stage [6, 5, 4, 1]" in summary  # min(U, S - s + k), 1F1B's 1 on the last stage
    assert "bubble 27.3%" in summary
    assert _rows(lines)[0][:7] == ["F0", "F1", "F2", "F3", "F4", "F5", "."]


def test_gpipe_alias_pipelines_and_actions(capsys: pytest.CaptureFixture[str]) -> None:
    summary, lines = _run(
        capsys, "--stages", "2", "--microbatches", "2", "--pipelines", "2", "--schedule", "gpipe", "--actions"
    )
    assert summary.startswith("schedule=afab stages=2 units=4 ")  # units = pipelines x micro-batches
    assert "bubble 20.0%" in summary  # 1 / (4 + 1)
    assert "peak stash per stage [4, 4]" in summary
    assert "Plan(schedule=afab, stages=2, units=4, advance_forwards=0, training=True)" in lines
    assert "  stage 1: 1RF0 1RF1 1F0 1RF2 1F1 1RF3 1F2 1F3 1B0 1SB0 1B1 1SB1 1B2 1SB2 1B3 1SB3" in lines


def test_costs_change_the_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    summary, _ = _run(capsys, "--stages", "3", "--microbatches", "4", "--forward-cost", "2", "--backward-cost", "3")
    assert "step time 30," in summary  # (4 + 3 - 1) * (2 + 3)


def test_unknown_schedule_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["schedule", "--schedule", "zigzag"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'zigzag'" in err
    for name in ("afab", "1f1b", "advance", "gpipe"):
        assert f"'{name}'" in err


def test_fractional_costs_still_draw_every_action(capsys: pytest.CaptureFixture[str]) -> None:
    _, lines = _run(capsys, "--stages", "2", "--microbatches", "2", "--forward-cost", "0.5", "--backward-cost", "1")
    for s, cells in _rows(lines).items():
        for u in range(2):
            assert f"F{u}" in cells and f"B{u}" in cells, (s, cells)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--microbatches", "0"], "--microbatches 0: must be at least 1"),
        (["--stages", "0"], "--stages 0: must be at least 1"),
        (["--pipelines", "-1"], "--pipelines -1: must be at least 1"),
        (["--advance-forwards", "-1", "--schedule", "advance"], "--advance-forwards -1: must be at least 0"),
        (["--forward-cost", "0"], "--forward-cost 0.0: must be a positive time"),
        (["--latency", "-1"], "--latency -1.0: must be >= 0"),
    ],
)
def test_bad_values_name_the_flag(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["schedule", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    out = capsys.readouterr().out
    for command in ("fit, validate, test, predict", "tune", "schedule", "whatif"):
        assert command in out


def test_tune_refuses_zero_profile_steps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["tune", "--profile-steps", "0", "--config", "examples/char_gpt.yaml"])
    assert exc.value.code == 2
    assert "--profile-steps 0: must be at least 1" in capsys.readouterr().err


def test_the_cli_shares_the_cores_between_cpu_stage_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before LightningCLI builds the model: otherwise each stage process starts torch's pool with every core."""
    import os

    import lightning_avgpipe
    from lightning_avgpipe.cli import AvgPipeCLI

    calls: list[int] = []
    monkeypatch.setattr(lightning_avgpipe, "share_cpu_threads", calls.append)
    before = dict(os.environ)
    try:
        AvgPipeCLI(
            args=["--config", "examples/char_gpt.yaml", "--data.init_args.max_chars", "20000"],
            run=False,
            save_config_callback=None,
        )
    finally:  # a Trainer may pick a MASTER_PORT; later multi-process tests must not inherit it
        for key in set(os.environ) - set(before):
            del os.environ[key]
    assert calls == [2]  # trainer.devices of the config, accelerator cpu
