"""The single-file checkpoint assembled by parts (``lightning_avgpipe/plugin/checkpoint/streamed.py``): each rank
keeps its parts of the tensors as it holds them (a ``DTensor``'s local shard, ZeRO-1's ``FlatPieces``, a plain
tensor), rank 0 receives them into one whole tensor at a time, and no rank calls ``DTensor.full_tensor``."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(600)


def _wholes() -> dict[str, torch.Tensor]:
    """The whole tensors every rank builds (the same seed): what the file must hold."""
    g = torch.Generator().manual_seed(3)
    return {
        "rows": torch.randn(6, 4, generator=g),  # Shard(0): each part received in place
        "cols": torch.randn(4, 6, generator=g),  # Shard(1): each part into a buffer of its size, then copied
        "uneven": torch.randn(5, 3, generator=g),  # Shard(0) of 5 rows over 2 ranks: 3 and 2
        "replicated": torch.randn(7, generator=g),  # Replicate: rank 0's copy, nothing sent
        "copies": torch.randn(3, 3, generator=g),  # a plain tensor on both ranks (the D copies): rank 0's
        "flat": torch.randn(6, 4, generator=g),  # ZeRO-1's flat slices: [0, 7) on rank 0, [7, 24) on rank 1
        "step": torch.tensor(5.0),  # a scalar
        "elsewhere": torch.randn(2, 5, generator=g),  # another stage's: rank 1's alone
        "big": torch.randn(16, 8, generator=g),  # the largest: Shard(0)
    }


def _worker(rank: int, world: int, out: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from lightning_avgpipe.plugin.checkpoint import sharded, streamed
    from lightning_avgpipe.runtime.files import torchfile
    from lightning_avgpipe.runtime.files.save_waits import SaveWaits
    from lightning_avgpipe.shards import is_dtensor

    mesh = init_device_mesh("cpu", (world,))
    w = _wholes()
    flat = w["flat"].reshape(-1)
    mine = [(0, flat[:7])] if rank == 0 else [(7, flat[7:])]
    state: dict[str, Any] = {
        "rows": distribute_tensor(w["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(w["cols"], mesh, [Shard(1)]),
        "uneven": distribute_tensor(w["uneven"], mesh, [Shard(0)]),
        "replicated": distribute_tensor(w["replicated"], mesh, [Replicate()]),
        "copies": w["copies"].clone(),
        "flat": sharded.FlatPieces((6, 4), mine),
        "step": w["step"].clone(),
        "big": distribute_tensor(w["big"], mesh, [Shard(0)]),
        **({"elsewhere": w["elsewhere"].clone()} if rank == 1 else {}),
    }
    calls = {"full_tensor": 0}
    full_tensor = DTensor.full_tensor

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["full_tensor"] += 1
        return full_tensor(self, *args, **kwargs)

    DTensor.full_tensor = counted  # type: ignore[method-assign]
    live = {"bytes": 0, "peak": 0, "count": 0, "most": 0, "sizes": []}
    empty = torch.empty

    def tracked(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = empty(*args, **kwargs)
        n = t.numel() * t.element_size()
        live["bytes"] += n
        live["count"] += 1
        live["sizes"].append(n)
        live["peak"] = max(live["peak"], live["bytes"])
        live["most"] = max(live["most"], live["count"])

        def freed(n: int = n) -> None:
            live["bytes"] -= n
            live["count"] -= 1

        weakref.finalize(t, freed)
        return t

    own = {
        t.untyped_storage().data_ptr()
        for v in state.values()
        for t in ([p for _, p in mine] if isinstance(v, sharded.FlatPieces) else [v.to_local() if is_dtensor(v) else v])
    }
    sent = {"own": 0, "copies": 0}
    isend = torch.distributed.isend

    def isend_own(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # a part sent from its own storage
        sent["own" if tensor.untyped_storage().data_ptr() in own else "copies"] += 1
        return isend(tensor, *args, **kwargs)

    path = Path(out) / "file.ckpt"
    try:
        outbox = streamed.Outbox()
        tree = {"state_dict": {k: sharded.to_refs(v, f"state_dict.{k}", outbox.tensors) for k, v in state.items()}}
        with SaveWaits("a test's save", 30.0, 60.0) as waits:
            parts = outbox.gather(tree, rank, world, waits)
            checkpoint = None
            if parts is not None:
                checkpoint = {"state_dict": {k: v for part in parts for k, v in part["state_dict"].items()}}
                checkpoint["state_dict"] = {k: checkpoint["state_dict"][k] for k in w}

            def write(prepared: Any, fetch: Any) -> None:  # rank 0's assembly: every allocation tracked
                torch.empty = tracked  # type: ignore[assignment]
                try:
                    torchfile.write(path, prepared, fetch, checksums=sharded.CHECKSUMS)
                finally:
                    torch.empty = empty  # type: ignore[assignment]

            torch.distributed.isend = isend_own
            streamed.transfer(checkpoint, outbox, rank, world, write, waits)
    finally:
        torch.distributed.isend = isend
        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
    # as Trainer.save_checkpoint's barrier does: rank 0 serves the store rank 1's last wait may still read
    torch.distributed.barrier()
    slots = (
        sorted(k for k, v in checkpoint["state_dict"].items() if isinstance(v, torchfile.Slot))
        if checkpoint is not None
        else []
    )
    return {"calls": calls, "live": live, "slots": slots, "sent": sent}


def test_a_file_is_assembled_one_whole_tensor_at_a_time_from_the_ranks_parts(tmp_path: Path) -> None:
    """Two gloo ranks, each holding its parts (Shard(0), Shard(1), uneven, Replicate, plain copies, ZeRO-1's flat
    pieces, a scalar, a tensor on rank 1 alone): the file holds every whole tensor, no ``full_tensor`` runs, rank 0
    allocates one whole tensor at a time (and one part's buffer beside it for a Shard(1) part), rank 1 nothing."""
    from lightning_avgpipe.runtime.files import checksums
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_worker, 2, str(tmp_path), timeout=120)
    w = _wholes()
    loaded = torch.load(tmp_path / "file.ckpt", weights_only=True)
    assert list(loaded["state_dict"]) == list(w)
    for key, value in w.items():
        torch.testing.assert_close(loaded["state_dict"][key], value, rtol=0, atol=0, msg=key)
    assert checksums.check_tensors(loaded, loaded["avgpipe_checksums"], "file") == len(w)
    assert [r["calls"]["full_tensor"] for r in results] == [0, 0]
    # rank 0 holds "copies", "replicated" and "step" whole: written as they are; the rest assembled
    assert results[0]["slots"] == sorted(k for k in w if k not in ("copies", "replicated", "step"))
    zero = results[0]["live"]
    biggest = w["big"].numel() * 4
    # rank 1 sends its parts of "rows", "cols", "uneven", "big", "elsewhere" and "flat" (two boxes: the rest of
    # row 1, rows 2 to 5) from their own storage
    assert results[1]["sent"] == {"own": 7, "copies": 0} and results[0]["sent"]["own"] == 0, results
    assert zero["most"] <= 2, zero  # one whole tensor, and at most one part's buffer beside it
    assert max(zero["sizes"]) == biggest, zero  # the largest allocation: one whole tensor
    cols_part = w["cols"].numel() * 4 // 2  # the only non-contiguous slice: Shard(1)'s part
    assert zero["peak"] <= biggest, zero
    assert cols_part in zero["sizes"] and w["cols"].numel() * 4 + cols_part <= biggest, zero
    slot_bytes = sorted(w[k].numel() * 4 for k in results[0]["slots"])
    assert sorted(n for n in zero["sizes"] if n not in (0, cols_part)) == slot_bytes, zero  # each whole once


@pytest.mark.slow
def test_a_full_shard_file_save_gathers_no_whole_tensor_and_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Lightning, D = 2 x S = 1 under FULL_SHARD (``averaging="exact"``, Adam): no ``DTensor.full_tensor`` runs in
    any save (ModelCheckpoint's or the final one), and the file holds the uninterrupted plain run's whole weights
    and Adam state under the unsplit names."""
    from tests.helpers.checkpoints import PLAIN_ORDER, STEPS, assert_states_close, fit_with_checkpoints
    from tests.helpers.equivalence import run_lightning

    plain_trainer, plain = fit_with_checkpoints(tmp_path / "plain", STEPS, named=True)
    strategy = {"num_stages": 1, "num_microbatches": 2, "averaging": "exact", "sharding_strategy": "FULL_SHARD"}
    run = {"steps": STEPS, "model": {"optimizer": "adam", "lr": 0.01}, "trainer": PLAIN_ORDER}
    results = run_lightning(tmp_path / "z3", 2, strategy, every_n_train_steps=2, count_full_tensor=True, **run)
    for r in results:  # two ModelCheckpoint saves and the final one, none gathering a whole tensor on any rank
        assert r["full_tensor_in_saves"] == {"saves": 3, "calls": 0, "inside": 0}, r["full_tensor_in_saves"]
    saved = torch.load(tmp_path / "z3" / "final.ckpt", weights_only=True)
    want = plain.state_dict()
    assert_states_close({k: v for k, v in saved["state_dict"].items() if k in want}, want)
    assert not any(k.startswith("layers.") and k not in want for k in saved["state_dict"])
    mine = saved["optimizer_states"][0]
    theirs = plain_trainer.optimizers[0].state_dict()

    def by_name(state: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
        names = {i: n for g in state["param_groups"] for i, n in zip(g["params"], g["param_names"])}
        return {names[i]: st for i, st in state["state"].items()}

    got, expected = by_name(mine), by_name(theirs)
    assert sorted(got) == sorted(expected) == sorted(want)
    for name, st in expected.items():
        for key, value in st.items():
            torch.testing.assert_close(
                got[name][key], value, rtol=1e-4, atol=1e-6, msg=lambda m, w=f"{name}.{key}": f"{w}: {m}"
            )


def _two_dim_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    """A (data = 2, tensor = 2) mesh: a colwise and a rowwise Linear, then FSDP2 over the data dimension (the
    weights 2D DTensors, as a stage's under T > 1 with a sharding_strategy); the file's whole tensors against
    ``full_tensor`` (taken after the save)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_avgpipe.plugin.checkpoint import sharded, streamed
    from lightning_avgpipe.runtime.files import torchfile
    from lightning_avgpipe.runtime.files.save_waits import SaveWaits

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 5))
    parallelize_module(model, mesh["tensor"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    for layer in model:
        fully_shard(layer, mesh=mesh["data"])
    state = {k: v.detach() for k, v in model.state_dict().items()}
    outbox = streamed.Outbox()
    tree = {"state_dict": {k: sharded.to_refs(v, f"state_dict.{k}", outbox.tensors) for k, v in state.items()}}
    path = Path(out) / "two_dim.ckpt"
    with SaveWaits("a test's save", 30.0, 60.0) as waits:
        parts = outbox.gather(tree, rank, world, waits)
        checkpoint = None
        if parts is not None:
            checkpoint = {"state_dict": {k: v for part in parts for k, v in part["state_dict"].items()}}

        def write(prepared: Any, fetch: Any) -> None:
            torchfile.write(path, prepared, fetch)

        streamed.transfer(checkpoint, outbox, rank, world, write, waits)
    placements = {k: [type(p).__name__ for p in v.placements] for k, v in state.items()}
    return {"whole": {k: v.full_tensor() for k, v in state.items()}, "placements": placements}


@pytest.mark.slow
def test_a_file_of_two_dimensional_dtensors_holds_their_whole_tensors(tmp_path: Path) -> None:
    """FSDP2 over (data) of a tensor-parallel model over (tensor), 4 ranks: each weight's parts (a strided shard
    over data of a Shard over tensor) make its whole tensor in the file."""
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_two_dim_worker, 4, str(tmp_path), timeout=180)
    loaded = torch.load(tmp_path / "two_dim.ckpt", weights_only=True)["state_dict"]
    whole = results[0]["whole"]
    assert sorted(loaded) == sorted(whole)
    assert all(len(p) == 2 for p in results[0]["placements"].values()), results[0]["placements"]
    for key, value in whole.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
