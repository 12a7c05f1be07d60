"""What a failing rank says: a recorded message is cut at a word's end, never mid-word; a rank that
raised the same error as the first failure gets no note; a rank stopped by another's failure says so; an error of
its own after another's quotes the first without claiming it stopped because of it. One process: the store's reads
are replaced by the record under test."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_avgpipe.runtime.failures import report as failures
from lightning_avgpipe.runtime.failures.report import PeerFailureError, handle_failure, shortened
from tests.helpers.launch import job_env


def test_a_long_message_is_cut_at_a_word_end() -> None:
    text = "AvgPipe: forward is not the layers of configure_pipeline() applied in order: it runs the layers, while " * 4
    short = shortened(text, 200)
    assert len(short) <= 200 and short.endswith(" ...")
    assert text.startswith(short[:-4]) and text[len(short) - 4] == " "  # the cut falls before a space
    assert shortened("short.", 200) == "short."


def _notes(exception: BaseException) -> str:
    return " ".join(getattr(exception, "__notes__", [])) + str(exception)


@pytest.mark.parametrize(
    ("first", "exception", "note"),
    [
        ("rank 0 (setup): ValueError: partition=[1, 5] is bad.", ValueError("partition=[1, 5] is bad."), None),
        ("rank 0 (stage 0): RuntimeError: boom", PeerFailureError("rank 1: rank 0 is gone"), "stopped because"),
        ("rank 0 (stage 0): RuntimeError: boom.", ValueError("my own"), "First failure: rank 0 (stage 0): Runtime"),
    ],
    ids=["same-error-everywhere", "consequence", "an-error-of-its-own"],
)
def test_the_note_a_rank_adds_says_what_happened(first: str, exception: BaseException, note: str | None) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(failures, "report_failure", lambda text: None)
        mp.setattr(failures, "recorded_failure", lambda: first)
        mp.setattr(failures, "wait_until_seen", lambda *a, **k: None)
        handle_failure(exception, "rank 1 (setup)", 1, 2)
    said = _notes(exception)
    if note is None:
        assert "First failure" not in said and "stopped because" not in said, said
    else:
        assert note in said, said
        assert ".." not in said.replace(" ...", ""), said  # no doubled period
        if note != "stopped because":
            assert "stopped because" not in said, said


def test_a_placeholder_refuses_to_pass_for_the_whole_model_after_the_run() -> None:
    """Issue 33, item 1 (the refusal): after a run, a module holding placeholders for other stages' layers refuses a
    forward, state_dict() (so PEFT's save_pretrained) and pickling, naming the cure; the strategy's own saves pass."""
    import copy

    import torch
    from torch import nn

    from lightning_avgpipe.plugin.split.placeholders import Elsewhere, Guard, NotWholeError

    guard = Guard()
    model = nn.Sequential(nn.Linear(2, 2), Elsewhere("layers.1", 1, guard))
    assert list(model.state_dict()) == ["0.weight", "0.bias"]  # during a run: the placeholders keep the keys
    guard.finished = True
    cure = r"'layers.1', a layer that ran on stage 1 .* MyModel.load_from_checkpoint\(path\)"
    with pytest.raises(NotWholeError, match="state_dict\\(\\) reached " + cure):
        model.state_dict()
    with pytest.raises(NotWholeError, match="its forward reached " + cure):
        model(torch.ones(1, 2))
    with pytest.raises(NotWholeError, match="pickling"):
        copy.deepcopy(model)
    with pytest.raises(NotWholeError, match=r"parameters\(\) reached " + cure):
        list(model.parameters())
    with pytest.raises(NotWholeError, match=r"parameters\(\) reached "):
        model.to(torch.float64)
    with guard.allowing():
        assert list(model.state_dict()) == ["0.weight", "0.bias"]
        assert len(list(model.parameters())) == 2
    assert guard.finished


def test_a_mistake_this_package_names_is_a_few_lines_and_its_traceback_goes_to_a_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """runtime/failures/console.py: raised by the package's own check, the message and where it came from, the traceback
    in the file the last line names (in the current directory when no trainer set a log directory); an error of the
    user's own code (raised outside the package) is left alone."""
    import re
    import sys

    from lightning_avgpipe.config import check_partition
    from lightning_avgpipe.runtime.failures.console import print_short, set_folder

    monkeypatch.chdir(tmp_path)
    set_folder(None)  # no log directory (an earlier Trainer of this process may have set one)
    try:
        check_partition([1, 2], 6, 2, 1)
    except ValueError:
        kind, value, tb = sys.exc_info()
    assert kind is not None and value is not None
    assert print_short(kind, value, tb)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2 and said[0].startswith("ValueError: partition=[1, 2] sums to 3"), said
    assert "raised at lightning_avgpipe/config.py:" in said[1] and "test_failure_messages.py:" in said[1], said
    path = Path(re.search(r"the full traceback: (\S+)\)", said[1]).group(1))  # type: ignore[union-attr]
    assert path.parent == tmp_path.resolve()
    assert "Traceback (most recent call last)" in path.read_text() and "check_partition" in path.read_text()
    try:
        raise ValueError("the user's own")
    except ValueError:
        assert not print_short(*sys.exc_info())  # type: ignore[arg-type]
    assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_bad_partition_prints_its_message_once_in_at_most_15_lines(tmp_path: pytest.TempPathFactory) -> None:
    """A 2-rank fit with partition=[1, 2] for 6 layers, as a user runs it: at most 15 lines on the console (Lightning's
    own banner included), the message once, no traceback there; the traceback in the file it names."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(str(tmp_path)) / "bad.py"
    root = Path(__file__).resolve().parents[1]
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "import lightning.pytorch as pl, torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from tests.helpers.lit import PipeNet\n"
        "from lightning_avgpipe import AvgPipeStrategy\n"
        "if __name__ == '__main__':\n"
        "    data = TensorDataset(torch.randn(24, 8), torch.randint(0, 4, (24,)))\n"
        "    strategy = AvgPipeStrategy(num_microbatches=2, partition=[1, 2])\n"
        "    trainer = pl.Trainer(accelerator='cpu', devices=2, strategy=strategy, max_steps=1, logger=False,\n"
        "                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)\n"
        "    trainer.fit(PipeNet(), DataLoader(data, batch_size=12))\n"
    )
    env = job_env()  # a fresh job, whatever an earlier test of this process left in the environment
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=str(tmp_path), env=env
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 1 and len(lines) <= 15, "\n".join(lines)
    text = "\n".join(lines)
    said = text.count("partition=[1, 2] sums to 3 layers")  # twice only where rank 1 recorded it first: the
    assert said == 1 or (said == 2 and "the same error" not in text), text  # launching process prints it whatever
    assert "Traceback" not in text, text
    path = Path(re.search(r"the full traceback: (\S+)\)", text).group(1))  # type: ignore[union-attr]
    assert "in check_partition" in path.read_text()
