"""What the setup says about where the model is built (issue 42, items 7, 9 and 10): an error inside
``configure_model`` in a few lines, the user's message first, its traceback in a file under the trainer's log
directory; a rank holding far more of the model than it runs is warned; ``from_pretrained`` on the meta device and
``setup()`` reading what ``configure_model()`` builds are told what to do."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_avgpipe.plugin.split import hints
from lightning_avgpipe.runtime.failures import console
from tests.helpers.launch import job_env

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """\
import os, sys
FIT = {fit!r}
sys.path.insert(0, {root!r})
import lightning.pytorch as pl, torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning_avgpipe
from lightning_avgpipe import AvgPipeStrategy
from lightning_avgpipe.plugin.split import hints

hints.HELD_MIN_BYTES = 0  # the test's model is small: any rank holding 1.5 times what it runs is warned

def layers():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

class Net(pl.LightningModule):
    def __init__(self, where):
        super().__init__()
        self.where = where
        if where == "init":
            self.layers = layers()

    def configure_model(self):
        if hasattr(self, "layers"):
            return
        self.layers = layers()
        if self.where == "bad_path":
            lightning_avgpipe.load_pretrained(self.layers, {missing!r})

    def configure_pipeline(self):
        return self.layers

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    wheres = {wheres!r}
    for where in wheres:  # one fit each, in the same two processes (a second Trainer reuses Lightning's ranks)
        if len(wheres) > 1 and os.environ.get("LOCAL_RANK", "0") == "0":  # rank 0, on stderr with the warnings
            print(f"{{FIT}}{{where}}", file=sys.stderr, flush=True)
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(24, 8), torch.randint(0, 4, (24,)))
        logger = pl.loggers.CSVLogger({logs!r}) if {csv!r} else False
        trainer = pl.Trainer(accelerator="cpu", devices=2,
                             strategy=AvgPipeStrategy(num_microbatches=2, partition=[3, 3]), max_steps=1,
                             logger=logger, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, default_root_dir={root_dir!r})
        trainer.fit(Net(where), DataLoader(data, batch_size=12))
"""
FIT = "== AvgPipe test: fit "  # the line the script prints (rank 0, stderr) before each of its fits


def _run(tmp_path: Path, *wheres: str, csv: bool = False) -> tuple[int, str]:
    """The script above as a user runs it (2 ranks by Lightning's launcher), from ``tmp_path``, one fit per model in
    ``wheres``: (exit code, output)."""
    script = tmp_path / "train.py"
    script.write_text(
        SCRIPT.format(
            root=str(ROOT),
            missing=str(tmp_path / "pretrainde"),
            logs=str(tmp_path / "logs"),
            csv=csv,
            root_dir=str(tmp_path / "root"),
            wheres=list(wheres),
            fit=FIT,
        )
    )
    env = job_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=str(tmp_path), env=env
    )
    return proc.returncode, (proc.stdout + proc.stderr).strip()


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("csv", [False, True], ids=["default_root_dir", "logger"])
def test_an_error_inside_configure_model_is_said_in_short_with_its_traceback_in_the_log_directory(
    tmp_path: Path, csv: bool
) -> None:
    """A wrong path given to load_pretrained in configure_model, on 2 ranks: at most 15 lines on the console
    (Lightning's banner included), the user's message on the first line of the error and nowhere a traceback or the
    teardown's "Cannot copy out of meta tensor"; each rank's traceback in a file under the log directory (the
    logger's version folder, else default_root_dir), which the message names."""
    code, out = _run(tmp_path, "bad_path", csv=csv)
    lines = out.splitlines()
    assert code == 1 and len(lines) <= 15, out
    assert "Cannot copy out of meta tensor" not in out and "Traceback" not in out, out
    message = f"FileNotFoundError: load_pretrained: there is no file {tmp_path / 'pretrainde'}."
    # once, or twice where rank 1 failed first: the launching process (rank 0) prints its message whatever, as it
    # may end rank 1 before rank 1 prints its own
    assert out.count(message) == 1 or (out.count(message) == 2 and "the same error" not in out), out
    errors = [i for i, line in enumerate(lines) if "Error: " in line]
    said = lines[errors[0]]
    assert said.endswith(message) or "FileNotFoundError: the same error as rank" in said, out  # message first
    where = r"raised in configure_model\(\), at lightning_avgpipe/runtime/build/pretrained\.py:\d+, from "
    assert re.search(where, out)
    assert f"{tmp_path / 'train.py'}:" in out, out  # the user's line that called load_pretrained
    folder = tmp_path / "logs" / "lightning_logs" / "version_0" if csv else tmp_path / "root"
    named = [Path(p) for p in re.findall(r"the full traceback: (\S+)\)", out)]
    assert named and all(p.parent == folder.resolve() and p.exists() for p in named), (named, folder)
    assert "Traceback (most recent call last)" in named[0].read_text()
    assert "in configure_model" in named[0].read_text() and "load_pretrained: there is no file" in named[0].read_text()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_rank_holding_the_whole_model_is_warned_and_one_building_on_the_meta_device_is_not(tmp_path: Path) -> None:
    """Two fits in one launch of 2 ranks, the output split where rank 0 says each fit starts: first the model built in
    ``configure_model`` (on the meta device), not warned; then the one built whole in ``__init__``, warned once."""
    code, out = _run(tmp_path, "configure_model", "init")
    assert code == 0, out[-3000:]
    starts = [FIT + where for where in ("configure_model", "init")]
    assert all(out.count(start) == 1 for start in starts), out[-3000:]
    _, meta, whole = out.replace(starts[1], starts[0]).split(starts[0])  # before, the first fit's, the second's
    for where, said in (("init", whole), ("configure_model", meta)):
        warned = [line for line in said.splitlines() if "the whole model (" in line]
        if where == "init":
            assert len(warned) == 1, said  # rank 0 says it for every rank, once
            assert re.search(
                r"AvgPipe: every rank holds the whole model \(9\.9 KiB\) and runs only its own stages of it "
                r"\(rank 0: 5\.\d KiB, rank 1: 4\.6 KiB\): build the model in configure_model\(\), and load weights "
                r"with lightning_avgpipe\.load_pretrained \(docs/guide\.md#a-model-larger-than-one-device\)",
                warned[0],
            ), warned[0]
        else:
            assert not warned and "runs only its own stages" not in said, said
    # in the whole output (stdout too, either rank) the init fit's warning is the only one
    assert sum("the whole model (" in line for line in out.splitlines()) == 1, out[-3000:]
    assert out.count("runs only its own stages") == 1, out[-3000:]


def _model() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))  # 16,640 bytes per layer


def test_the_holding_warning_weighs_what_a_rank_holds_against_what_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built whole: each rank holds 66,560 bytes and runs half; on the meta device nothing is held beyond what is run;
    the thresholds (1.5 times, and HELD_MIN_BYTES more) decide."""
    model = _model()
    layers, sizes = list(model), [2, 2]
    monkeypatch.setattr(hints, "HELD_MIN_BYTES", 0)
    said = hints.holding_warning(model, layers, sizes, {0: [0], 1: [1]})
    assert said is not None and said.startswith(
        "AvgPipe: every rank holds the whole model (65.0 KiB) and runs only its own stages of it "
        "(rank 0: 32.5 KiB, rank 1: 32.5 KiB): build the model in configure_model()"
    ), said
    assert "lightning_avgpipe.load_pretrained (docs/guide.md#a-model-larger-than-one-device)" in said
    one = hints.holding_warning(model, layers, [3, 1], {0: [0], 1: [1]})  # rank 0 runs 3/4: under 1.5 times
    assert one == (
        "AvgPipe: rank 1 holds the whole model (65.0 KiB) and runs 16.2 KiB of it: build the model in "
        "configure_model(), and load weights with lightning_avgpipe.load_pretrained "
        "(docs/guide.md#a-model-larger-than-one-device); each rank then holds only what it runs."
    ), one
    monkeypatch.setattr(hints, "HELD_MIN_BYTES", 40_000)  # rank 1's 49,920 extra bytes are over, rank 0's under
    assert hints.holding_warning(model, layers, sizes, {0: [0], 1: [1]}) is None
    assert hints.holding_warning(model, layers, [3, 1], {0: [0], 1: [1]}) == one
    monkeypatch.setattr(hints, "HELD_MIN_BYTES", 0)
    with torch.device("meta"):
        late = _model()
    assert hints.holding_warning(late, list(late), sizes, {0: [0], 1: [1]}) is None
    late[0] = nn.Linear(64, 64)  # one layer on a real device on every rank: rank 1 holds it too, 2 of 3 it runs
    partly = hints.holding_warning(late, list(late), sizes, {0: [0], 1: [1]})
    assert partly is None  # 49,920 held against 33,280 run: exactly 1.5 times, not over


def test_from_pretrained_on_the_meta_device_names_load_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(Exception) as raised, torch.device("meta"):
        transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    said = hints.meta_build_error(raised.value)
    assert said is not None
    text = str(said)
    assert "LlamaForCausalLM(AutoConfig.from_pretrained(path))" in text
    assert "lightning_avgpipe.load_pretrained(model, path)" in text and "torch.device('cpu')" not in text, text
    value = hints.meta_build_error(NotImplementedError("Cannot copy out of meta tensor; no data!"))
    assert value is not None and "lightning_avgpipe.load_pretrained(model, path)" in str(value)
    assert hints.meta_build_error(ValueError("my own")) is None


class _Late(torch.nn.Module):
    """Stands in for a LightningModule: a ``setup`` that reads what ``configure_model`` builds."""

    def configure_model(self) -> None:
        self.llm = nn.Linear(2, 2)

    def setup(self, stage: str) -> None:
        self.llm.weight.zero_()

    def setup_other(self) -> None:
        self.other.weight.zero_()


def test_an_attribute_setup_reads_before_configure_model_builds_it_gets_a_note() -> None:
    module = _Late()
    with pytest.raises(AttributeError) as raised:
        module.setup("fit")
    hints.note_setup_order(raised.value, module)
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1 and "Lightning calls configure_model() after setup(), so `self.llm`" in notes[0], notes
    assert "lightning_avgpipe.load_pretrained(self.llm, path)" in notes[0]
    with pytest.raises(AttributeError) as other:  # not one configure_model builds
        module.other  # noqa: B018
    hints.note_setup_order(other.value, module)
    assert not getattr(other.value, "__notes__", [])
    module.configure_model()
    del module.llm
    with pytest.raises(AttributeError) as outside:  # not in setup()
        module.llm  # noqa: B018
    hints.note_setup_order(outside.value, module)
    assert not getattr(outside.value, "__notes__", [])


def test_a_labelled_error_of_the_users_is_said_in_short_with_its_traceback_in_the_folder_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def configure_model() -> None:
        raise KeyError("my own mistake")

    console.set_folder(tmp_path / "logs")
    try:
        try:
            configure_model()
        except KeyError as err:
            console.mark(err, "configure_model()")
            assert console.print_short(type(err), err, err.__traceback__)
    finally:
        console.set_folder(None)
    said = capsys.readouterr().err.splitlines()
    assert said[0] == "KeyError: 'my own mistake'", said
    path = tmp_path / "logs" / f"lightning_avgpipe-traceback-rank{os.environ.get('RANK', '0')}-pid{os.getpid()}.txt"
    assert (
        len(said) == 2
        and said[1].startswith("(raised in configure_model(), at ")
        and said[1].endswith(f"; the full traceback: {path})")
    ), said
    assert "in configure_model" in path.read_text()


def test_an_error_of_the_build_gets_no_first_failure_note_each_rank_says_its_own() -> None:
    """Two ranks whose replayed builds fail differently (each reads its own shard): each prints its own message, and the
    second quotes nothing of the first (it printed it itself); an unlabelled error still gets the note."""
    from lightning_avgpipe.runtime.failures import report as failures

    first = "rank 1 (setup): ValueError: load_pretrained: shard-4's 'w' is (64, 96); the model's is (64, 128)."
    labelled = ValueError("load_pretrained: shard-2's 'v' is (64, 96); the model's is (64, 128).")
    plain = ValueError("x")
    console.mark(labelled, "configure_model()'s build, replayed at setup")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(failures, "report_failure", lambda text: None)
        mp.setattr(failures, "recorded_failure", lambda: first)
        mp.setattr(failures, "wait_until_seen", lambda *a, **k: None)
        failures.handle_failure(labelled, "rank 0 (setup)", 0, 2)
        failures.handle_failure(plain, "rank 0 (setup)", 0, 2)
    assert not getattr(labelled, "__notes__", []), labelled.__notes__
    assert "First failure: rank 1 (setup)" in " ".join(getattr(plain, "__notes__", []))
