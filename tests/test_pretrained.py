"""Pretrained weights per stage (runtime/pretrained.py): a Hugging Face checkpoint saved in shards loads as
``from_pretrained`` loads it, and under a recorded meta build each rank reads only the tensors it keeps. Needs
transformers (the ``hf`` extra: CI's Hugging Face phase); nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_avgpipe import load_pretrained
from lightning_avgpipe.runtime import pretrained
from lightning_avgpipe.runtime.init_record import InitRecord
from lightning_avgpipe.runtime.materialize import materialize

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
