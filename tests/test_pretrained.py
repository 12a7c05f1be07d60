"""Pretrained weights per stage (runtime/build/pretrained.py): a Hugging Face checkpoint saved in shards loads as
``from_pretrained`` loads it, and under a recorded meta build each rank reads only the tensors it keeps. Needs
transformers (the ``hf`` extra: CI's Hugging Face phase); nothing is downloaded."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_avgpipe import load_pretrained
from lightning_avgpipe.runtime.build import pretrained
from lightning_avgpipe.runtime.build.init_record import InitRecord
from lightning_avgpipe.runtime.build.materialize import materialize
from tests.helpers.launch import job_env

transformers = pytest.importorskip("transformers")


def tiny_llama(tied: bool) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return config


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny Llama saved by save_pretrained in several shards (``model.safetensors.index.json``)."""
    torch.manual_seed(1)
    config = tiny_llama(request.param)
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="40KB")
    assert len(json.loads((path / pretrained.INDEX).read_text())["weight_map"]) > 0
    assert len(list(path.glob("*.safetensors"))) > 2  # several shards
    return path, config


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_load_pretrained_equals_from_pretrained(saved: tuple[Path, Any]) -> None:
    path, config = saved
    reference = transformers.LlamaForCausalLM.from_pretrained(path)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config)
    loaded = load_pretrained(model, path)
    assert not loaded.missing and not loaded.unexpected and not loaded.deferred
    _same(model.state_dict(), reference.state_dict())
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    # a file saved from the base model (no "model." prefix) loads into the model with a head, and the reverse
    base = transformers.LlamaModel.from_pretrained(path)
    assert base.state_dict()["norm.weight"].data_ptr() != 0
    _same(
        base.state_dict(),
        {k.removeprefix("model."): v for k, v in reference.state_dict().items() if "lm_head" not in k},
    )
    fresh = transformers.LlamaModel(config)
    load_pretrained(fresh, path)
    _same(fresh.state_dict(), base.state_dict())


def test_a_recorded_build_reads_only_the_tensors_a_rank_keeps(saved: tuple[Path, Any], monkeypatch: Any) -> None:
    """The build on the meta device, then replayed keeping one decoder layer (and, tied, the embedding through the
    head): the kept tensors equal from_pretrained's, and only their keys were read."""
    path, config = saved
    reference = transformers.LlamaForCausalLM.from_pretrained(path).state_dict()
    read: list[str] = []
    real_open = pretrained._safe_open()

    class Counting:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self) -> Counting:
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> Any:
            return self.f.keys()

        def get_tensor(self, key: str) -> torch.Tensor:
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(pretrained, "_safe_open", lambda: Counting)
    record = InitRecord()
    with torch.device("meta"), record:
        model = transformers.LlamaForCausalLM(config)
        loaded = load_pretrained(model, path)
    assert loaded.deferred and not read  # nothing read while building
    keep_modules = [model.model.layers[1], model.lm_head]
    keep = {id(t) for m in keep_modules for t in m.parameters()}
    materialize(model, lambda t: id(t) in keep, record, torch.device("cpu"))
    state = model.state_dict()
    own = [n for n, t in model.state_dict(keep_vars=True).items() if id(t) in keep]
    head_key = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    expected = {("model.layers.1." + n) for n, _ in model.model.layers[1].named_parameters()} | {head_key}
    assert set(read) == expected, sorted(set(read) ^ expected)
    for name in own:
        assert torch.equal(state[name], reference[name if name in reference else "model.embed_tokens.weight"]), name
    assert state["model.layers.0.mlp.up_proj.weight"].is_meta  # another rank's: never made real


def test_bad_paths_and_a_meta_model_outside_a_build_are_refused(tmp_path: Path, saved: tuple[Path, Any]) -> None:
    path, config = saved
    with pytest.raises(FileNotFoundError, match=r"holds neither model.safetensors.index.json nor model.safetensors"):
        load_pretrained(transformers.LlamaForCausalLM(config), tmp_path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(RuntimeError, match="on the meta device outside AvgPipeStrategy's recorded build"):
        load_pretrained(model, path)


# -- strict by default (issue 42, item 6) ------------------------------------------------------------------------------


def _single_file(path: Path, state: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.detach().clone() for k, v in state.items()}, str(path))
    return path


class Holder(torch.nn.Module):
    """A model kept one attribute down, as a LightningModule keeps ``self.net``: its names are ``net.model...``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.net = transformers.LlamaForCausalLM(config)


def test_a_tensor_missing_from_the_file_is_named_unless_strict_is_false(tmp_path: Path) -> None:
    torch.manual_seed(1)
    config = tiny_llama(False)
    state = transformers.LlamaForCausalLM(config).state_dict()
    file = _single_file(tmp_path / "w.safetensors", {k: v for k, v in state.items() if k != "model.norm.weight"})
    model = transformers.LlamaForCausalLM(config)
    before = model.model.norm.weight.detach().clone()
    with pytest.raises(ValueError) as refused:
        load_pretrained(model, file)
    said = str(refused.value)
    assert said == (
        f"load_pretrained: 1 of the module's {len(state)} tensors has no key in {file}: model.norm.weight. "
        "Pass strict=False to leave them as initialized (Loaded.missing lists them)."
    )
    loaded = load_pretrained(model, file, strict=False)  # today's behaviour: loaded, the tensor left as initialized
    assert loaded.missing == ["model.norm.weight"] and not loaded.unexpected
    assert torch.equal(model.model.norm.weight, before)
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])


def test_nothing_matching_shows_the_nearest_names_and_the_submodule_that_matches(saved: tuple[Path, Any]) -> None:
    """The model held one attribute down (``net.model...`` against the folder's ``model...``): 0 matched, refused
    with the nearest names of both sides and ``module.net``, which then loads as from_pretrained does."""
    path, config = saved
    holder = Holder(config)
    total = len(holder.state_dict())
    with pytest.raises(ValueError) as refused:
        load_pretrained(holder, path)
    lines = str(refused.value).splitlines()
    assert lines[0].startswith(f"load_pretrained: only 0 of the module's {total} tensors match a key of {path} ("), (
        lines
    )
    assert lines[1] == "  module: net.model.embed_tokens.weight  file: model.embed_tokens.weight", lines
    assert len(lines) == 5 and all(line.startswith("  module: net.model.") for line in lines[1:4]), lines
    fix = lines[4]
    assert fix.startswith("The module's names have 'net.' in front: pass module.net instead of the module ("), fix
    assert f"({total} of its {total} tensors match then); or pass strict=False" in fix, fix
    assert all(p.is_meta is False for p in holder.parameters())
    loaded = load_pretrained(holder.net, path)  # the fix the message names
    assert not loaded.missing
    _same(holder.net.state_dict(), transformers.LlamaForCausalLM.from_pretrained(path).state_dict())
    assert load_pretrained(Holder(config), path, strict=False).keys == {}  # strict=False: nothing loaded, no error


def test_under_half_matching_names_the_prefix_the_files_keys_carry(tmp_path: Path) -> None:
    """A file whose keys have ``llm.`` in front (saved from a LightningModule's state dict): ``prefix='llm.'`` is
    named, and works; a file holding one decoder layer of three is refused without a prefix to suggest."""
    torch.manual_seed(1)
    config = tiny_llama(False)
    state = transformers.LlamaForCausalLM(config).state_dict()
    total = len(state)
    file = _single_file(tmp_path / "lit.safetensors", {"llm." + k: v for k, v in state.items()})
    with pytest.raises(ValueError) as refused:
        load_pretrained(transformers.LlamaForCausalLM(config), file)
    lines = str(refused.value).splitlines()
    assert lines[1] == "  module: model.embed_tokens.weight  file: llm.model.embed_tokens.weight", lines
    assert lines[-1].startswith(
        f"The file's keys have 'llm.' in front: pass prefix='llm.' ({total} of the module's {total} tensors match then)"
    ), lines
    model = transformers.LlamaForCausalLM(config)
    assert not load_pretrained(model, file, prefix="llm").missing  # with or without the final dot
    _same(model.state_dict(), state)
    # both sides: the model one attribute down, the file's keys with llm. in front
    with pytest.raises(ValueError, match=r"'net.' in front, the file's keys 'llm.': pass module.net instead of the "):
        load_pretrained(Holder(config), file)
    # less than half, and no prefix makes more match: the nearest names, and strict=False
    few = _single_file(tmp_path / "few.safetensors", {k: v for k, v in state.items() if ".layers.0." in k})
    with pytest.raises(ValueError) as refused:
        load_pretrained(transformers.LlamaForCausalLM(config), few)
    lines = str(refused.value).splitlines()
    matched = sum(".layers.0." in k for k in state)
    assert lines[0] == (
        f"load_pretrained: only {matched} of the module's {total} tensors match a key of {few} ({matched} keys). "
        "Nearest names:"
    )
    assert lines[1].startswith("  module: model.embed_tokens.weight  file: model.layers.0."), lines
    assert lines[-1] == (
        "No prefix on either side makes them match: pass strict=False to load what matches (Loaded.missing lists "
        "the rest)."
    )


def test_a_strict_refusal_in_a_recorded_build_is_raised_at_the_call(tmp_path: Path, saved: tuple[Path, Any]) -> None:
    """On the meta device (configure_model) the check needs only the names: raised at the call, before any rank
    makes a tensor real, the same on every rank (each builds the whole model and reads every header). The strategy's
    build adds its hint on values read on the meta device to no such error, a path saying "meta" included."""
    import contextlib
    import shutil

    from lightning_avgpipe.plugin.split.stages import recorded_build

    path, config = saved
    folder = tmp_path / "meta-llama"
    shutil.copytree(path, folder)
    with pytest.raises(ValueError) as refused, recorded_build(contextlib.nullcontext(), []):
        load_pretrained(Holder(config), folder)
    said = str(refused.value)
    assert said.startswith("load_pretrained: only 0 of") and "pass module.net instead" in said, said
    assert "AvgPipe builds configure_model()" not in said, said


def _torch_save(path: Path) -> None:
    torch.save({"model.norm.weight": torch.ones(32)}, path)


def _random_bytes(path: Path) -> None:
    path.write_bytes(
        torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).byte().numpy().tobytes()
    )


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_random_bytes, r"it is damaged, or of another format \(safetensors: .*header too large\)"),
        (_torch_save, r"it is a zip archive, as torch.save writes \(load_pretrained reads safetensors files only\)"),
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), r"it is truncated \(\d+ of the \d+ bytes its header lists\)"),
        (lambda p: p.write_bytes(p.read_bytes()[:20]), r"it is truncated \(its header alone is \d+ bytes; the file"),
        (lambda p: p.write_bytes(b""), r"it is empty"),
    ],
    ids=["random-bytes", "torch-save", "truncated", "truncated-header", "empty"],
)
def test_an_unreadable_file_is_named(tmp_path: Path, saved: tuple[Path, Any], damage: Any, reason: str) -> None:
    """A single file, and one shard of a folder: the error names the file (the shard, read on every rank while the
    model is built, not later by the one rank that holds its tensors) and what it holds instead."""
    import shutil

    path, config = saved
    single = _single_file(tmp_path / "model.safetensors", transformers.LlamaForCausalLM(config).state_dict())
    damage(single)
    folder = tmp_path / "folder"
    shutil.copytree(path, folder)
    shard = sorted(folder.glob("*.safetensors"))[1]
    damage(shard)
    for given, named in ((single, single), (tmp_path, single), (folder, shard)):
        with pytest.raises(ValueError) as refused:
            load_pretrained(transformers.LlamaForCausalLM(config), given)
        said = str(refused.value)
        assert said.startswith(f"load_pretrained: {named} is not a readable safetensors file: "), said
        assert re.search(reason, said), said
        assert len(said) < 300, said


def test_a_shard_the_index_names_but_the_folder_lacks_is_named(tmp_path: Path, saved: tuple[Path, Any]) -> None:
    import shutil

    path, config = saved
    folder = tmp_path / "folder"
    shutil.copytree(path, folder)
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"there is no file {re.escape(str(shard))} \\(a shard that "):
        load_pretrained(transformers.LlamaForCausalLM(config), folder)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_two_rank_fit_with_names_that_do_not_match_ends_on_every_rank(tmp_path: Path) -> None:
    """The issue's case as a user meets it: ``load_pretrained(self, file)`` inside configure_model, the model held
    as ``self.net``. Every rank builds the whole model and takes the same decision, so every rank raises the same
    error at the call and the job ends at once (no rank waits for another), with the message and its fix. (The chained
    teardown error that follows it is issue 42's item 7.)"""
    import subprocess
    import sys
    import time

    from safetensors.torch import save_file

    save_file(
        {f"{i}.{n}": torch.ones(8, 8) if n == "weight" else torch.ones(8) for i in (0, 2) for n in ("weight", "bias")},
        str(tmp_path / "w.safetensors"),
    )
    script = tmp_path / "fit.py"
    root = Path(__file__).resolve().parents[1]
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(root)!r})\n"
        "import lightning.pytorch as pl, torch\n"
        "from torch import nn\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from lightning_avgpipe import AvgPipeStrategy, load_pretrained\n"
        "class Net(pl.LightningModule):\n"
        "    def configure_model(self):\n"
        "        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))\n"
        "        load_pretrained(self, 'w.safetensors')\n"
        "    def configure_pipeline(self):\n"
        "        return self.net\n"
        "    def training_step(self, batch, i):\n"
        "        return self.net(batch[0]).square().mean()\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "if __name__ == '__main__':\n"
        "    data = TensorDataset(torch.randn(8, 8))\n"
        "    strategy = AvgPipeStrategy(num_microbatches=2, p2p_timeout=300)\n"
        "    trainer = pl.Trainer(accelerator='cpu', devices=2, strategy=strategy,\n"
        "                         max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,\n"
        "                         enable_checkpointing=False)\n"
        "    trainer.fit(Net(), DataLoader(data, batch_size=4))\n"
    )
    env = job_env(OMP_NUM_THREADS="1")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=str(tmp_path), env=env
    )
    took = time.monotonic() - start
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    assert "load_pretrained: only 0 of the module's 4 tensors match a key of w.safetensors (4 keys)" in text, text
    assert "  module: net.0.weight  file: 0.weight" in text, text
    assert "The module's names have 'net.' in front: pass module.net instead of the module (4 of its 4" in text, text
    assert took < 100, took  # a rank left waiting for another would wait p2p_timeout (300 s) before its watchdog


def test_a_pretrained_tensor_to_be_split_is_made_real_whole_only_when_read_in(saved: tuple[Path, Any]) -> None:
    """A loaded tensor to be split (a shard) is made real whole at its read, not at its init (the read fills it whole):
    the replay holds at most one such whole tensor at once, and the shards kept are from_pretrained's."""
    path, config = saved
    reference = transformers.LlamaForCausalLM.from_pretrained(path).state_dict()
    record = InitRecord()
    with torch.device("meta"), record:
        model = transformers.LlamaForCausalLM(config)
        load_pretrained(model, path)
    layer = model.model.layers[1]
    kept: dict[str, torch.Tensor] = {}

    def keep_half(name: str) -> Any:
        def place(whole: torch.Tensor) -> torch.Tensor:
            kept[name] = whole[: (whole.shape[0] + 1) // 2].clone()
            return kept[name]

        return place

    shards = [(f"model.layers.1.{n}", p, keep_half(f"model.layers.1.{n}")) for n, p in layer.named_parameters()]
    report = materialize(model, lambda t: False, record, torch.device("cpu"), shards)
    assert kept.keys() == {name for name, _, _ in shards}
    for name, value in kept.items():
        assert torch.equal(value, reference[name][: value.shape[0]]), name
    largest = max(p.numel() * p.element_size() for p in layer.parameters())
    assert report.peak_other_bytes <= largest, (report.peak_other_bytes, largest)
