"""A LightningModule that reaches its pipeline layers by a second path (``self.gpt = gpt`` kept beside wrappers around
``gpt``'s layers, to call ``gpt.generate()`` later): the checkpoint holds the trained weights under every name, no rank
keeps another stage's weights through the second path, and the setup log names it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_avgpipe.plugin.split.second_paths import second_paths
from tests.helpers.equivalence import final_state, run_lightning
from tests.helpers.lit import AliasedNet, loader, reference
from tests.helpers.models import make_layers


def test_second_paths_are_found_outside_the_layers_only() -> None:
    gpt = nn.Module()
    gpt.transformer = nn.ModuleDict({"wte": nn.Embedding(5, 4), "h": nn.ModuleList([nn.Linear(4, 4)])})
    gpt.head = nn.Linear(4, 5)
    root = nn.Module()
    root.gpt = gpt  # registered first: its names come first
    embed = nn.Sequential(gpt.transformer["wte"])  # a wrapper around the embedding
    root.stages = nn.ModuleList([embed, gpt.transformer["h"][0], nn.Sequential(gpt.head)])
    found = second_paths(root, list(root.stages), [0, 1, 1])
    assert {(a.path, a.name, tuple(a.stages)) for a in found} == {
        ("gpt.transformer.wte", "stages.0.0", (0,)),
        ("gpt.head", "stages.2.0", (1,)),
    }  # gpt.transformer.h.0 is a layer itself under two names: the split replaces it under both
    plain = nn.Sequential(*make_layers())
    assert second_paths(plain, list(plain), [0, 0, 0, 1, 1, 1]) == []


@pytest.mark.slow
def test_a_module_that_keeps_its_whole_model_beside_the_wrappers_checkpoints_both_names(tmp_path: Path) -> None:
    strategy = {"num_microbatches": 4, "partition": [3, 3]}
    results = run_lightning(tmp_path, 2, strategy, aliased=True, limit_val_batches=4)
    ref_losses, ref_state = reference(4, 4)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses))
    state = final_state(tmp_path)
    for key, value in ref_state.items():  # layers.3.weight and wrapped.3.inner.weight: the trained values, both
        index, rest = key.removeprefix("layers.").split(".", 1)
        torch.testing.assert_close(state[key], value, msg=lambda msg, key=key: f"{key}: {msg}")
        torch.testing.assert_close(state[f"wrapped.{index}.inner.{rest}"], value)
    whole = sum(p.numel() for p in AliasedNet().parameters())
    assert results[0]["parameters"] + results[1]["parameters"] == whole  # no rank holds the other's layers
    out = results[0]["output"]
    assert "a second path: layers.0 is wrapped.0.inner (stage 0), layers.1 is wrapped.1.inner (stage 0)" in out, out
    # on one device, the checkpoint gives the pipelined run's validation loss
    loaded = AliasedNet.load_from_checkpoint(tmp_path / "final.ckpt")
    with torch.no_grad():
        val = torch.stack([F.cross_entropy(loaded(x), y) for x, y in loader()]).mean().item()
    assert val == pytest.approx(results[0]["metrics"]["val_loss"], rel=1e-5)
