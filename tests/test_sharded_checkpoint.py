"""Sharded checkpoints (``save_distributed_checkpoint=True``, plugin/checkpoint/sharded.py): every rank writes its own
part, a resume in the same layout is exact and another layout takes the state by name, ``consolidate`` writes the single
file bit for bit, and a folder that is incomplete, foreign or unsafe is refused by name."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_avgpipe import AvgPipeStrategy
from lightning_avgpipe.plugin.checkpoint import dcp_reader, sharded
from lightning_avgpipe.runtime.files import checksums, torchfile
from tests.helpers.checkpoints import fit_pipenet
from tests.helpers.equivalence import run_lightning
from tests.helpers.lit import PipeNet, loader, quiet_trainer

# every run reads the batches in the loader's order and is checkpointed at an epoch's end (4 steps): resumes are exact
PLAIN_ORDER = {"use_distributed_sampler": False}
ADAM = {"optimizer": "adam", "lr": 0.01}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal trees, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def forge(folder: Path, name: str, data: bytes) -> None:
    """Write ``data`` as the folder's file ``name`` and record its checksum in ``avgpipe.pt``, as a forger would."""
    (folder / name).write_bytes(data)
    meta = torch.load(folder / sharded.META, weights_only=True)
    meta[sharded.FILES][name] = checksums.file_entry(folder / name, 0)
    torch.save(meta, folder / sharded.META)


def consolidated(folder: Path, out: Path) -> dict[str, Any]:
    sharded.consolidate(folder, out)
    return torch.load(out, weights_only=True)


# -- the streamed file ------------------------------------------------------------------------------------------
def test_a_streamed_file_is_read_by_torch_load_as_torch_saves_is(tmp_path: Path) -> None:
    import collections

    values = {
        "w": torch.randn(300, 7),
        "i": torch.arange(5),
        "h": torch.randn(4, 4).to(torch.bfloat16),
        "e": torch.empty(0, 3),
        "t": torch.randn(3, 5).t(),  # not contiguous
    }
    slots = collections.OrderedDict((k, torchfile.Slot.of(k, v)) for k, v in values.items())
    obj = {"state_dict": slots, "epoch": 3, "opt": [{"step": torch.tensor(5.0), "lr": 0.1}], "t": (1, "x", None)}
    sizes: list[int] = []

    def fetch(key: str) -> torch.Tensor:  # asked one tensor at a time, after the previous one is written
        sizes.append(os.path.getsize(tmp_path / "f.ckpt"))
        return values[key]

    torchfile.write(tmp_path / "f.ckpt", obj, fetch)
    assert sizes == sorted(sizes) and len(set(sizes)) == len(values)
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "f.ckpt", weights_only=True, mmap=mmap)
        assert type(loaded["state_dict"]) is collections.OrderedDict
        assert_same(loaded, {**obj, "state_dict": collections.OrderedDict(values)})

    with pytest.raises(ValueError, match=r"fetched for 'w' is \(2,\) torch.float32; its slot said \(300, 7\)"):
        torchfile.write(tmp_path / "g.ckpt", {"w": slots["w"]}, lambda key: torch.zeros(2))


# -- one process ------------------------------------------------------------------------------------------------
_fit = fit_pipenet  # PipeNet, Adam, AvgPipeStrategy(num_microbatches=2), ModelCheckpoint under root/every


@pytest.mark.timeout(120)
def test_one_process_saves_a_folder_that_resumes_and_consolidates_to_the_single_file(tmp_path: Path) -> None:
    _, straight = _fit(tmp_path / "straight", 8, save_top_k=-1, every_n_train_steps=4)
    folder = tmp_path / "straight" / "every" / "epoch=0-step=4.ckpt"
    assert folder.is_dir() and {sharded.META, sharded.DCP_META} <= set(os.listdir(folder))
    _, resumed = _fit(tmp_path / "resumed", 8, str(folder))
    assert_same(resumed.state_dict(), straight.state_dict())

    _, plain_file = _fit(tmp_path / "file", 4, sdc=False)
    single = torch.load(tmp_path / "file" / "every" / "epoch=0-step=4.ckpt", weights_only=True)
    whole = consolidated(folder, tmp_path / "whole.ckpt")
    for key in ("state_dict", "optimizer_states", "loops", "epoch", "global_step"):
        assert_same(whole[key], single[key], key)
    # what users read the single file with
    assert_same(PipeNet.load_from_checkpoint(tmp_path / "whole.ckpt").state_dict(), plain_file.state_dict())
    out = subprocess.run(
        [sys.executable, "-m", "lightning_avgpipe", "consolidate", str(folder), str(tmp_path / "cli.ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert_same(torch.load(tmp_path / "cli.ckpt", weights_only=True)["state_dict"], whole["state_dict"])


@pytest.mark.timeout(120)
def test_top_k_deletes_folders_and_a_save_replaces_what_is_there(tmp_path: Path) -> None:
    _fit(tmp_path, 4, monitor="train_loss", save_top_k=1, every_n_train_steps=1, filename="{step}")
    kept = list((tmp_path / "every").iterdir())  # the best of the four saved: the others' folders removed
    assert len(kept) == 1 and kept[0].is_dir() and (kept[0] / sharded.META).exists(), kept

    trainer, model = _fit(tmp_path / "again", 1)
    target = tmp_path / "target.ckpt"
    target.write_bytes(b"an older single-file checkpoint")
    trainer.save_checkpoint(target)  # a file replaced by a folder, only once the folder is complete
    assert target.is_dir() and not list(tmp_path.glob(".target.ckpt*"))
    trainer.save_checkpoint(target)  # and a folder by a folder
    assert_same(consolidated(target, tmp_path / "t.ckpt")["state_dict"], model.state_dict())


@pytest.mark.timeout(120)
def test_incomplete_foreign_and_unsafe_folders_are_refused_by_name(tmp_path: Path, monkeypatch: Any) -> None:
    trainer, model = _fit(tmp_path, 1)
    good = tmp_path / "good.ckpt"
    trainer.save_checkpoint(good)
    before = consolidated(good, tmp_path / "before.ckpt")

    # a save killed after every rank wrote, before rank 0's avgpipe.pt: the previous checkpoint stays whole
    def killed(path: Path, meta: Any, files: Any = None) -> None:
        raise SystemExit("killed")

    monkeypatch.setattr(sharded, "finish", killed)
    with pytest.raises(SystemExit):
        trainer.save_checkpoint(good)
    monkeypatch.undo()
    assert_same(consolidated(good, tmp_path / "after.ckpt"), before)
    staged = tmp_path / f".good.ckpt{sharded.INCOMPLETE}"
    assert staged.is_dir()
    with pytest.raises(ValueError, match=r"not a complete checkpoint: it has no avgpipe.pt"):
        sharded.check_folder(staged)
    with pytest.raises(FileNotFoundError, match="There is no checkpoint folder"):
        sharded.check_folder(tmp_path / "absent")

    def copy(name: str) -> Path:
        shutil.copytree(good, tmp_path / name)
        return tmp_path / name

    lost = copy("lost")
    (lost / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"incomplete: rank\(s\) \[0\]'s file\(s\) \['__0_0.distcp'\] are missing"):
        _fit(tmp_path / "r1", 2, str(lost))

    foreign = copy("foreign")
    (foreign / sharded.META).unlink()
    with pytest.raises(ValueError, match="not written by AvgPipeStrategy"):
        sharded.check_folder(foreign)

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    unsafe = copy("unsafe")
    forge(unsafe, sharded.DCP_META, pickle.dumps(Evil()))  # a forger rewrites the checksum too
    with pytest.raises(ValueError, match=r"Refusing to load .*names (posix|os)\.system"):
        sharded.check_folder(unsafe)
    unsafe_meta = copy("unsafe_meta")
    buffer = io.BytesIO()
    torch.save({"state_dict": Evil()}, buffer)
    (unsafe_meta / sharded.META).write_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match="Refusing to load .*avgpipe.pt"):
        _fit(tmp_path / "r2", 2, str(unsafe_meta))
    assert not (tmp_path / "pwned").exists()

    with pytest.raises(TypeError, match=r"save_distributed_checkpoint='yes' must be True .* or False"):
        AvgPipeStrategy(save_distributed_checkpoint="yes")  # type: ignore[arg-type]


# -- several ranks ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_stages_write_their_own_stage_resume_exactly_and_move_to_one_device(tmp_path: Path) -> None:
    """S = 2: each rank's file holds only its stage's tensors; the resume is bit for bit the uninterrupted run; the
    consolidated file is the single-file mode's, bit for bit; S = 1 and plain Lightning resume from it."""
    base = {"num_microbatches": 2, "partition": [3, 3]}
    run = {"steps": 8, "model": ADAM, "every_n_train_steps": 4, "trainer": PLAIN_ORDER}
    file_run = run_lightning(tmp_path / "file", 2, base, **run)
    shard_run = run_lightning(tmp_path / "shard", 2, {**base, "save_distributed_checkpoint": True}, **run)
    assert shard_run[0]["losses"] == file_run[0]["losses"]
    mid = tmp_path / "shard" / "every" / "epoch=0-step=4.ckpt"

    # every rank wrote its own stage's weights and Adam state (layers 0-2 on rank 0, 3-5 on rank 1)
    metadata = dcp_reader.load_metadata(mid)
    files: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        key = index.fqn.split(".")
        if key[0] == "state_dict" or key[2] == "state":
            files.setdefault(info.relative_path, set()).add(key[2] if key[0] == "state_dict" else key[4])
    assert files == {"__0_0.distcp": {"0", "2"}, "__1_0.distcp": {"3", "5"}}, files

    whole = consolidated(tmp_path / "shard" / "final.ckpt", tmp_path / "whole.ckpt")
    single = torch.load(tmp_path / "file" / "final.ckpt", weights_only=True)
    for key in ("state_dict", "optimizer_states", "loops", "global_step"):
        assert_same(whole[key], single[key], key)

    resumed = run_lightning(
        tmp_path / "resumed", 2, {**base, "save_distributed_checkpoint": True}, ckpt_path=str(mid), **run
    )
    assert resumed[0]["losses"] == shard_run[0]["losses"][4:]
    assert_same(
        consolidated(tmp_path / "resumed" / "final.ckpt", tmp_path / "r.ckpt")["state_dict"], whole["state_dict"]
    )

    # another layout (S = 1, one process) from the folder, and plain Lightning from its consolidated file
    trainer, one = _fit(tmp_path / "one", 8, str(mid), every_n_train_steps=100)
    assert all(int(s["step"]) == 8 for s in trainer.optimizers[0].state_dict()["state"].values())
    ref = {k: v for k, v in whole["state_dict"].items() if k.startswith("layers.")}
    torch.testing.assert_close({k: v for k, v in one.state_dict().items() if k in ref}, ref, rtol=1e-5, atol=1e-6)
    consolidated(mid, tmp_path / "mid.ckpt")
    torch.manual_seed(0)
    plain = PipeNet(**ADAM)
    quiet_trainer(tmp_path / "plain", max_steps=8, **PLAIN_ORDER).fit(plain, loader(), ckpt_path=tmp_path / "mid.ckpt")
    torch.testing.assert_close({k: v for k, v in plain.state_dict().items() if k in ref}, ref, rtol=1e-5, atol=1e-6)

    # 64 bytes flipped inside rank 1's weights: the file and its writer are named, on consolidate and on resume
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(mid, damaged)
    data = bytearray((damaged / "__1_0.distcp").read_bytes())
    at = data.find(
        torch.load(tmp_path / "mid.ckpt", weights_only=True)["state_dict"]["layers.3.weight"].numpy().tobytes()
    )
    assert at > 0
    data[at : at + 64] = bytes(b ^ 0xFF for b in data[at : at + 64])
    (damaged / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"damaged: its file __1_0.distcp \(written by rank 1\) does not match"):
        consolidated(damaged, tmp_path / "d.ckpt")
    with pytest.raises(ValueError, match=r"__1_0.distcp \(written by rank 1\)"):
        _fit(tmp_path / "from-damaged", 8, str(damaged), every_n_train_steps=100)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tensor_shards_and_replicas_resume_exactly_from_a_folder(tmp_path: Path) -> None:
    """T = 2 on one stage with N = 2 elastic replicas (2 ranks): tensors saved as their shards, each rank's replicas
    and optimizers under its rank; a resume in the same layout continues bit for bit."""
    from tests.helpers.checkpoints import TP_PLAN

    strategy = {"num_stages": 1, "num_microbatches": 2, "num_pipelines": 2, "tensor_parallel_size": 2}
    strategy.update(tensor_parallel_plan=TP_PLAN, save_distributed_checkpoint=True)  # type: ignore[arg-type]
    straight = run_lightning(tmp_path / "straight", 2, strategy, steps=4, model=ADAM, every_n_train_steps=2)
    mid = tmp_path / "straight" / "every" / "epoch=0-step=2.ckpt"
    metadata = dcp_reader.load_metadata(mid)
    chunks = metadata.state_dict_metadata["state_dict.layers.3.weight"].chunks
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (8, 0)]  # the two row shards, as they are
    assert any(k.startswith("optimizer_states.0.rank1.replicas") for k in metadata.state_dict_metadata)
    rest = run_lightning(tmp_path / "resumed", 2, strategy, steps=4, model=ADAM, ckpt_path=str(mid))
    assert rest[0]["losses"] == straight[0]["losses"][2:]
    a = consolidated(tmp_path / "straight" / "final.ckpt", tmp_path / "a.ckpt")
    b = consolidated(tmp_path / "resumed" / "final.ckpt", tmp_path / "b.ckpt")
    assert_same(a["state_dict"], b["state_dict"])
    assert_same(a["optimizer_states"][0]["avgpipe_ranks"], b["optimizer_states"][0]["avgpipe_ranks"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_groups_with_sharded_optimizer_state_resume_exactly_from_a_folder(tmp_path: Path) -> None:
    """D = 2 groups of one stage, exact averaging, ZeRO-1: the groups' copies of a weight are written once, each
    parameter's whole Adam state by the group that steps it; the resume continues bit for bit and consolidates to the
    single file's state."""
    strategy = {"num_stages": 1, "num_microbatches": 2, "averaging": "exact", "shard_optimizer_state": True}
    run = {"steps": 8, "model": ADAM, "every_n_train_steps": 4, "trainer": PLAIN_ORDER}
    sharded_strategy = {**strategy, "save_distributed_checkpoint": True}
    straight = run_lightning(tmp_path / "straight", 2, sharded_strategy, **run)
    mid = tmp_path / "straight" / "every" / "epoch=0-step=4.ckpt"
    metadata = dcp_reader.load_metadata(mid)
    weight = [i for i in metadata.storage_data if i.fqn == "state_dict.layers.0.weight"]
    assert len(weight) == 1  # one copy written, not one per group
    # Adam's moments as each group's flat slice holds them: boxes of the whole tensors, from both ranks' files
    files = {info.relative_path for i, info in metadata.storage_data.items() if i.fqn.endswith(".exp_avg") and i.offset}
    split = [k for k, md in metadata.state_dict_metadata.items() if k.endswith(".exp_avg") and len(md.chunks) > 1]
    assert files == {"__0_0.distcp", "__1_0.distcp"} and split, (files, split)
    rest = run_lightning(tmp_path / "resumed", 2, sharded_strategy, ckpt_path=str(mid), **run)
    assert rest[0]["losses"] == straight[0]["losses"][4:]
    a = consolidated(tmp_path / "straight" / "final.ckpt", tmp_path / "a.ckpt")
    b = consolidated(tmp_path / "resumed" / "final.ckpt", tmp_path / "b.ckpt")
    assert_same(a["state_dict"], b["state_dict"])
    assert_same(a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"])
    state = a["optimizer_states"][0]
    assert set(state["state"]) == set(state["param_groups"][0]["params"])  # every parameter's state, whole


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_elastic_replicas_with_a_sharded_reference_resume_exactly_from_a_folder(tmp_path: Path) -> None:
    """N = 2 elastic replicas on D = 2 groups with the reference sharded (shard_optimizer_state): each rank's replicas,
    their optimizers and its slice of the averaging's state under its rank; the resume continues bit for bit."""
    strategy = {
        "num_stages": 1,
        "num_microbatches": 2,
        "num_pipelines": 2,
        "shard_optimizer_state": True,
        "save_distributed_checkpoint": True,
    }
    run = {"steps": 8, "model": ADAM, "every_n_train_steps": 4, "trainer": PLAIN_ORDER}
    straight = run_lightning(tmp_path / "straight", 2, strategy, **run)
    mid = tmp_path / "straight" / "every" / "epoch=1-step=4.ckpt"  # two batches a step: step 4 ends epoch 1
    keys = dcp_reader.load_metadata(mid).state_dict_metadata
    assert any(k.startswith("optimizer_states.0.rank1.") for k in keys) and any(".rank0." in k for k in keys)
    rest = run_lightning(tmp_path / "resumed", 2, strategy, ckpt_path=str(mid), **run)
    assert rest[0]["losses"] == straight[0]["losses"][4:]
    a = consolidated(tmp_path / "straight" / "final.ckpt", tmp_path / "a.ckpt")
    b = consolidated(tmp_path / "resumed" / "final.ckpt", tmp_path / "b.ckpt")
    assert_same(a["state_dict"], b["state_dict"])
