"""What a failing rank says (issue 33, item 7): a recorded message is cut at a word's end, never mid-word; a rank that
raised the same error as the first failure gets no note; a rank stopped by another's failure says so; an error of
its own after another's quotes the first without claiming it stopped because of it. One process: the store's reads
are replaced by the record under test."""

from __future__ import annotations

import pytest

from lightning_avgpipe.runtime import failures
from lightning_avgpipe.runtime.failures import PeerFailureError, handle_failure, shortened


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

    from lightning_avgpipe.plugin.bridge import Elsewhere, Guard, NotWholeError

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
    with guard.allowing():
        assert list(model.state_dict()) == ["0.weight", "0.bias"]
    assert guard.finished
