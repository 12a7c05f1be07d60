"""A checkpoint is a trust boundary (issue 42): a crafted folder runs no code, a damaged file is named and never
loads silently, a full disk is said as such, and an interrupted replace never makes a resume start over.

Each attack is first shown to be live (what torch's own reader would do with it: run the payload, load wrong
weights), then refused by the strategy's load (what ``fit(ckpt_path=)`` calls) and by ``consolidate``.
"""

from __future__ import annotations

import errno
import importlib
import os
import pickle
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_avgpipe.plugin.checkpoint import dcp_reader, sharded
from lightning_avgpipe.runtime.files import checksums
from lightning_avgpipe.runtime.files.disk_full import no_space
from tests.helpers.checkpoints import fit_pipenet
from tests.helpers.launch import job_env
from tests.helpers.lit import PipeNet

ADAM = {"optimizer": "adam", "lr": 0.01}
PLAIN_ORDER = {"use_distributed_sampler": False}


_fit = fit_pipenet  # PipeNet, Adam, AvgPipeStrategy(num_microbatches=2), ModelCheckpoint under root/every


def _cli_consolidate(folder: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightning_avgpipe", "consolidate", str(folder), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _forge(folder: Path, name: str, data: bytes) -> None:
    """Write the folder's file ``name`` and its checksum in ``avgpipe.pt``, as a forger would."""
    (folder / name).write_bytes(data)
    meta = torch.load(folder / sharded.META, weights_only=True)
    meta[sharded.FILES][name] = checksums.file_entry(folder / name, 0)
    torch.save(meta, folder / sharded.META)


def _without_checksums(folder: Path) -> None:
    """The folder as a save from before checksums left it (or a forger who dropped them)."""
    meta = torch.load(folder / sharded.META, weights_only=True)
    meta.pop(sharded.FILES)
    torch.save(meta, folder / sharded.META)


def _global_call(module: str, name: str, arg: str, opcode: str = "stack") -> bytes:
    """A pickle that looks up ``module.name`` (STACK_GLOBAL, protocol 4, or GLOBAL) and calls it with ``arg``."""

    def text(s: str) -> bytes:
        raw = s.encode()
        return b"X" + len(raw).to_bytes(4, "little") + raw

    if opcode == "stack":
        head = b"\x80\x04" + text(module) + text(name) + b"\x93"
    else:
        head = b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n"
    return head + text(arg) + b"\x85R."


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[pl.Trainer, Path, Path]:
    """One fit of 4 steps: the trainer (its strategy set up, to load with), a folder and a single file of it."""
    root = tmp_path_factory.mktemp("saved")
    trainer, _ = _fit(root, 4)
    folder = root / "every" / "epoch=0-step=4.ckpt"
    single = root / "single.ckpt"
    trainer.strategy.save_distributed_checkpoint = False  # type: ignore[attr-defined]
    trainer.save_checkpoint(single)
    trainer.strategy.save_distributed_checkpoint = True  # type: ignore[attr-defined]
    return trainer, folder, single


def _copy(src: Path, dst: Path) -> Path:
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dst


# -- 1. no code from a crafted folder ----------------------------------------------------------------------------
def test_a_metadata_reaching_os_through_an_allowed_module_runs_nothing(saved: Any, tmp_path: Path) -> None:
    _, folder, _ = saved
    marker = tmp_path / "pwned"
    payload = _global_call("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    pickle.loads(payload)  # live: plain unpickling (torch's own reader) runs it
    assert marker.exists()
    marker.unlink()

    crafted = _copy(folder, tmp_path / "crafted.ckpt")
    _forge(crafted, sharded.DCP_META, payload)  # the checksum matches: only the reader stands in the way
    with pytest.raises(
        dcp_reader.UnsafeCheckpointError, match=r"names torch.distributed.checkpoint.metadata.os.system"
    ):
        _fit(tmp_path / "resume", 5, str(crafted))
    out = _cli_consolidate(crafted, tmp_path / "out.ckpt")
    assert out.returncode != 0 and "Refusing to load" in out.stderr and "trusted_checkpoints=True" in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 3, out.stderr
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()


def test_a_bytes_item_pointing_at_a_pickle_in_the_folder_runs_nothing(saved: Any, tmp_path: Path) -> None:
    """A ``.metadata`` of allowed classes only, declaring a weight as ``BytesStorageMetadata`` in a file of the
    folder: DCP's default planner reads such an item with ``torch.load(weights_only=False)``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    _, folder, _ = saved
    marker = tmp_path / "pwned"

    class Touch:
        def __reduce__(self) -> Any:
            return (Path.touch, (marker,))

    crafted = _copy(folder, tmp_path / "crafted.ckpt")
    metadata = dcp_reader.load_metadata(crafted)
    key = "state_dict.layers.0.weight"
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {i: info for i, info in metadata.storage_data.items() if i.fqn != key}
    body = pickle.dumps(Touch())
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__0_1.distcp", 0, len(body))
    _forge(crafted, "__0_1.distcp", body)
    _forge(crafted, sharded.DCP_META, pickle.dumps(metadata))

    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):  # live: torch's own reader and planner run it (then fail)
        dcp.load({key: torch.empty(0)}, storage_reader=dcp.FileSystemReader(crafted), no_dist=True)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(dcp_reader.UnsafeCheckpointError, match=r"declares 'state_dict.layers.0.weight' as Bytes"):
        _fit(tmp_path / "resume", 5, str(crafted))
    out = _cli_consolidate(crafted, tmp_path / "out.ckpt")
    assert out.returncode != 0 and "declares 'state_dict.layers.0.weight' as BytesStorageMetadata" in out.stderr
    assert not marker.exists()


def _reachable() -> list[tuple[str, str]]:
    """Every global name reachable from each module the reader allows: its own names, and one level into each
    module it holds (``os.system`` through ``torch.distributed.checkpoint.metadata``), torch's own excepted (its
    names are swept as ``torch``'s)."""
    names = []
    for module in dcp_reader.ALLOWED:
        mod = importlib.import_module(module)
        for name in dir(mod):
            names.append((module, name))
            inner = getattr(mod, name, None)
            if isinstance(inner, types.ModuleType) and inner.__name__ != "torch" and module != "torch":
                names += [(module, f"{name}.{n}") for n in dir(inner)]
    return names


@pytest.mark.timeout(300)
def test_no_global_outside_the_list_is_looked_up_on_resume_or_consolidate(saved: Any, tmp_path: Path) -> None:
    trainer, folder, _ = saved
    marker = tmp_path / "pwned"
    crafted = _copy(folder, tmp_path / "crafted.ckpt")
    _without_checksums(crafted)  # a forger drops the checksums: every .metadata below reaches the reader
    names = _reachable()
    assert len(names) > 3000 and ("torch.distributed.checkpoint.metadata", "os.system") in names

    def refused_by_both_loads(i: int, module: str, name: str) -> None:
        opcode = "global" if i % 2 and "." not in name else "stack"
        (crafted / sharded.DCP_META).write_bytes(_global_call(module, name, f"touch {marker}", opcode))
        for load in (trainer.strategy.load_checkpoint, lambda p: sharded.consolidate(p, tmp_path / "out.ckpt")):
            with pytest.raises(ValueError) as info:
                load(crafted)
            if name in dcp_reader.ALLOWED[module]:  # an allowed constructor called with a string: no metadata
                assert "damaged" in str(info.value), (module, name, info.value)
            else:
                assert isinstance(info.value, dcp_reader.UnsafeCheckpointError), (module, name, info.value)
                assert f"names {module}.{name}," in str(info.value)

    refused_by_both_loads(0, "torch.distributed.checkpoint.metadata", "os.system")  # the whole avgpipe.pt
    # Both loads read avgpipe.pt whole before .metadata, and only its checksums (dropped) decide what comes next:
    # the forger keeps its layout alone, read in a seventh of the time of the whole (Lightning's skeleton)
    meta = torch.load(crafted / sharded.META, weights_only=True)
    torch.save({sharded.SHARDED: meta[sharded.SHARDED]}, crafted / sharded.META)
    allowed = refused = 0
    for i, (module, name) in enumerate(names):
        refused_by_both_loads(i, module, name)
        allowed += name in dcp_reader.ALLOWED[module]
        refused += name not in dcp_reader.ALLOWED[module]
    assert not marker.exists()
    assert allowed <= sum(len(v) for v in dcp_reader.ALLOWED.values()) and refused > 3000, (allowed, refused)


# -- 2. integrity ------------------------------------------------------------------------------------------------
def _flip(path: Path, needle: bytes) -> None:
    """64 bytes flipped where ``needle`` (a tensor's bytes) lies in ``path``."""
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, "the tensor's bytes are not in the file"
    data[at : at + 64] = bytes(b ^ 0x5A for b in data[at : at + 64])
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_shard_is_named_not_loaded(saved: Any, tmp_path: Path) -> None:
    trainer, folder, _ = saved
    weight = trainer.lightning_module.state_dict()["layers.0.weight"]

    old = _copy(folder, tmp_path / "old.ckpt")  # live: without checksums, the damage loads with exit 0
    _without_checksums(old)
    _flip(old / "__0_0.distcp", weight.numpy().tobytes())
    sharded.consolidate(old, tmp_path / "silent.ckpt")
    silent = torch.load(tmp_path / "silent.ckpt", weights_only=True)["state_dict"]["layers.0.weight"]
    assert (silent != weight).sum() == 16

    damaged = _copy(folder, tmp_path / "damaged.ckpt")
    _flip(damaged / "__0_0.distcp", weight.numpy().tobytes())
    said = r"damaged: its file __0_0.distcp \(written by rank 0\) does not match the checksum"
    with pytest.raises(checksums.DamagedCheckpointError, match=said):
        _fit(tmp_path / "resume", 5, str(damaged))
    out = _cli_consolidate(damaged, tmp_path / "out.ckpt")
    assert out.returncode != 0 and "__0_0.distcp (written by rank 0) does not match" in out.stderr
    assert not (tmp_path / "out.ckpt").exists()


def test_truncated_files_are_named_as_truncated_not_as_unsafe(saved: Any, tmp_path: Path) -> None:
    trainer, folder, single = saved
    cases = {
        "__0_0.distcp": r"its file __0_0.distcp \(written by rank 0\) is truncated or damaged: \d+ bytes where \d+",
        sharded.DCP_META: r"its file .metadata \(written by rank 0\) is truncated or damaged",
        sharded.META: r"its avgpipe.pt \(written by rank 0\) is truncated or damaged",
    }
    for name, said in cases.items():
        cut = _copy(folder, tmp_path / f"cut{name}.ckpt")
        data = (cut / name).read_bytes()
        (cut / name).write_bytes(data[: len(data) // 2])
        for load in (trainer.strategy.load_checkpoint, lambda p: sharded.consolidate(p, tmp_path / "o.ckpt")):
            with pytest.raises(ValueError, match=said) as info:
                load(cut)
            assert "Refusing" not in str(info.value) and "run code" not in str(info.value)
    old = _copy(folder, tmp_path / "old.ckpt")  # no checksum to compare with: still damaged, not unsafe
    _without_checksums(old)
    data = (old / sharded.DCP_META).read_bytes()
    (old / sharded.DCP_META).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"its .metadata is truncated or damaged") as info:
        sharded.consolidate(old, tmp_path / "o.ckpt")
    assert "Refusing" not in str(info.value)

    cut = _copy(single, tmp_path / "cut-single.ckpt")
    cut.write_bytes(cut.read_bytes()[:-300])
    with pytest.raises(ValueError, match=r"Cannot read the checkpoint .*cut-single.ckpt: it is truncated or corrupt"):
        trainer.strategy.load_checkpoint(cut)


def test_a_single_file_holds_each_tensors_checksum_and_a_flip_is_named(saved: Any, tmp_path: Path) -> None:
    trainer, _, single = saved
    loaded = torch.load(single, weights_only=True)
    recorded = loaded[sharded.CHECKSUMS]
    assert recorded["algorithm"] == "crc32" and "state_dict/layers.0.weight" in recorded["tensors"]
    assert checksums.check_tensors(loaded, recorded, single) == len(recorded["tensors"]) > 10
    assert PipeNet.load_from_checkpoint(single).state_dict().keys() == loaded["state_dict"].keys()  # plain Lightning

    weight = loaded["state_dict"]["layers.3.weight"]
    damaged = _copy(single, tmp_path / "damaged.ckpt")
    _flip(damaged, weight.numpy().tobytes())
    assert not torch.equal(torch.load(damaged, weights_only=True)["state_dict"]["layers.3.weight"], weight)  # live
    with pytest.raises(checksums.DamagedCheckpointError, match=r"its tensor state_dict/layers.3.weight does not"):
        _fit(tmp_path / "resume", 5, str(damaged))


# -- 4. a full disk ----------------------------------------------------------------------------------------------
def _small_disk(where: Path, size: str) -> Path:
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return where


def test_a_full_disk_is_named_and_the_previous_checkpoint_stays_whole(saved: Any, tmp_path: Path) -> None:
    trainer, folder, single = saved
    disk = _small_disk(tmp_path / "disk", "1m")
    try:
        for sdc, name in ((True, "folder.ckpt"), (False, "file.ckpt")):
            trainer.strategy.save_distributed_checkpoint = sdc  # type: ignore[attr-defined]
            target = disk / name
            trainer.save_checkpoint(target)
            before = (
                torch.load(sharded.interrupted(target) or target, weights_only=True)
                if not sdc
                else sharded.check_folder(target)[0]
            )
            free = shutil.disk_usage(disk).free
            (disk / "filler").write_bytes(b"\0" * (free - 4096))
            with pytest.raises(OSError, match=r"No space left on device while writing .*\(free: 0 MiB\)") as info:
                trainer.save_checkpoint(target)
            assert info.value.errno == errno.ENOSPC and len(str(info.value).splitlines()) <= 15
            left = sorted(p.name for p in disk.iterdir())
            assert left == sorted(["filler", "folder.ckpt", *(["file.ckpt"] if not sdc else [])]), left
            if sdc:  # the previous checkpoint is whole and loads
                assert sharded.check_folder(target)[0].keys() == before.keys()
                trainer.strategy.load_checkpoint(target)
            else:
                assert torch.load(target, weights_only=True).keys() == before.keys()
                trainer.strategy.load_checkpoint(target)
            (disk / "filler").unlink()
    finally:
        trainer.strategy.save_distributed_checkpoint = True  # type: ignore[attr-defined]
        subprocess.run(["umount", str(disk)], check=False)


def test_no_space_recognises_errno_through_dcps_exception(tmp_path: Path) -> None:
    """DCP raises a ``CheckpointException`` (a ``BaseException``) holding each rank's error."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as err:
        wrapped = CheckpointException("failed", {1: _wrap_exception(err)})
    said = no_space(wrapped, tmp_path / "__1_0.distcp")
    assert isinstance(said, OSError) and said.errno == errno.ENOSPC and "__1_0.distcp" in str(said)
    assert no_space(RuntimeError("unexpected pos 704 vs 598"), tmp_path / "x") is None  # disk not full


# -- 5. an interrupted replace -----------------------------------------------------------------------------------
def test_a_resume_from_last_after_a_kill_between_the_renames_resumes_not_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    every = {"every_n_train_steps": 4, "save_last": True, "save_top_k": 0}  # at each epoch's end: resumes exact
    _, straight = _fit(tmp_path / "straight", 16, **every)
    _fit(tmp_path / "run", 4, **every)
    last = tmp_path / "run" / "every" / "last.ckpt"
    assert last.is_dir()

    def killed_between(tmp: Path, path: Path) -> None:  # the fallback's first rename done, then killed
        os.replace(path, sharded.replaced(path))
        raise SystemExit("killed between the renames")

    def interrupted_run(steps: int) -> None:
        monkeypatch.setattr(sharded, "put_in_place", killed_between)
        with pytest.raises(SystemExit):
            _fit(tmp_path / "run", steps, ckpt="last", **every)
        monkeypatch.undo()
        assert not last.exists() and sharded.replaced(last).is_dir() and sharded.staging(last).is_dir()

    interrupted_run(8)
    sharded.consolidate(last, tmp_path / "c.ckpt")  # reads the complete copy where it lies, renaming nothing
    assert torch.load(tmp_path / "c.ckpt", weights_only=True)["global_step"] == 8 and not last.exists()

    # no launcher of ours finished it before Lightning looked (torchrun, or a second fit in this process): the setup
    # puts it back and stops, naming it
    with pytest.raises(RuntimeError, match=r'ckpt_path="last"\) found no last checkpoint: .*Run again'):
        _fit(tmp_path / "run", 12, ckpt="last", **every)
    assert last.is_dir() and not sharded.replaced(last).exists()

    # a fresh process, as after a crash: the launcher puts the new one in place before Lightning looks
    interrupted_run(12)
    script = (
        "import sys, torch, lightning.pytorch as pl\n"
        "from lightning_avgpipe import AvgPipeStrategy\n"
        "from tests.helpers.lit import PipeNet, loader, quiet_trainer\n"
        "torch.manual_seed(0); model = PipeNet(optimizer='adam', lr=0.01); root = sys.argv[1]\n"
        "every = pl.callbacks.ModelCheckpoint(dirpath=root + '/every', every_n_train_steps=4, save_last=True, "
        "save_top_k=0)\n"
        "trainer = quiet_trainer(root, max_steps=16, callbacks=[every], use_distributed_sampler=False, "
        "strategy=AvgPipeStrategy(num_microbatches=2, save_distributed_checkpoint=True))\n"
        "trainer.fit(model, loader(), ckpt_path='last')\n"
        "torch.save({'step': trainer.global_step, 'weights': model.state_dict()}, root + '/result.pt')\n"
    )
    env = job_env(PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the new checkpoint (.last.ckpt.incomplete) is back in its place" in done.stderr
    assert last.is_dir() and not sharded.replaced(last).exists() and not sharded.staging(last).exists()
    result = torch.load(tmp_path / "run" / "result.pt", weights_only=True)
    assert result["step"] == 16
    for key, value in straight.state_dict().items():
        torch.testing.assert_close(result["weights"][key], value, rtol=0, atol=0)


def test_an_interrupted_replace_with_neither_copy_complete_names_both(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    sharded.replaced(path).mkdir()
    sharded.staging(path).mkdir()
    with pytest.raises(ValueError, match=r"neither .*\.last\.ckpt\.replaced .* nor .*\.last\.ckpt\.incomplete"):
        sharded.interrupted(path)
    with pytest.raises(ValueError, match="neither"):
        sharded.recover(path)
    assert sharded.recover(path, quiet=True) is None


def test_a_replace_swaps_in_one_step_where_it_can(saved: Any, tmp_path: Path, monkeypatch: Any) -> None:
    trainer, _, _ = saved
    target = tmp_path / "t.ckpt"
    trainer.save_checkpoint(target)
    seen: list[bool] = []
    exchange = sharded._exchange

    def watched(a: Path, b: Path) -> bool:
        seen.append(exchange(a, b))
        return seen[-1]

    monkeypatch.setattr(sharded, "_exchange", watched)
    trainer.save_checkpoint(target)
    assert len(seen) == 1  # True on Linux file systems with renameat2 (ext4, tmpfs, xfs, btrfs, overlayfs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.ckpt"]
    monkeypatch.setattr(sharded, "_exchange", lambda a, b: False)  # elsewhere: the two renames
    trainer.save_checkpoint(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.ckpt"]
    sharded.check_folder(target)
