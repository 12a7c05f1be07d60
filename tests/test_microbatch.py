"""Pure units for ``lightning_avgpipe.algorithms.microbatch``: split, merge, batch_size and signature."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from lightning_avgpipe.algorithms import microbatch

Pair = namedtuple("Pair", ["x", "y"])


def _assert_same(a: object, b: object) -> None:
    """Structural equality with exact tensor values and types."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype  # type: ignore[union-attr]
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert list(a) == list(b)  # type: ignore[arg-type]
        for k in a:
            _assert_same(a[k], b[k])  # type: ignore[index]
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            _assert_same(x, y)
    else:
        assert a == b


def _batches() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, generator=g)
    y = torch.arange(6)
    return {
        "tensor": x,
        "tuple": (x, y),
        "list": [x, y],
        "dict": {"input": x, "target": y},
        "ordered_dict": OrderedDict(target=y, input=x),
        "namedtuple": Pair(x, y),
        "nested": {"pair": Pair(x, [y, y * 2]), "mask": x > 0},
    }


@pytest.mark.parametrize("name", list(_batches()))
@pytest.mark.parametrize("chunks", [1, 2, 3, 6])
def test_split_merge_round_trip(name: str, chunks: int) -> None:
    batch = _batches()[name]
    parts = microbatch.split(batch, chunks)
    assert len(parts) == chunks
    for part in parts:
        assert type(part) is type(batch)
        assert microbatch.batch_size(part) == 6 // chunks
    _assert_same(microbatch.merge(parts), batch)


def test_split_keeps_samples_in_order() -> None:
    x = torch.arange(6)
    parts = microbatch.split({"x": x, "y": x * 10}, 3)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [p["y"].tolist() for p in parts] == [[0, 10], [20, 30], [40, 50]]
    assert isinstance(parts[0], dict)
    assert microbatch.split(Pair(x, x), 2)[1]._fields == ("x", "y")


def test_split_shares_non_tensor_leaves() -> None:
    class Vocab:
        pass

    names = ["a", "b", "c", "d"]
    vocab = Vocab()
    batch = {"x": torch.zeros(4, 2), "names": names, "vocab": vocab, "meta": {"epoch": 3}, "flag": None}
    parts = microbatch.split(batch, 2)
    for part in parts:
        assert part["vocab"] is vocab
        assert part["flag"] is None
        # Containers are rebuilt around the shared leaves; nothing that is not a tensor is sliced along the batch.
        assert part["names"] == names and part["names"][0] is names[0]
        assert part["meta"] == {"epoch": 3}
    merged = microbatch.merge(parts)
    torch.testing.assert_close(merged["x"], batch["x"])
    assert merged["vocab"] == [vocab, vocab]  # non-tensor step outputs come back one per micro-batch


@pytest.mark.parametrize(
    ("size", "chunks", "sizes"),
    [(7, 3, [3, 2, 2]), (5, 2, [3, 2]), (10, 4, [3, 3, 2, 2]), (3, 3, [1, 1, 1]), (5, 1, [5])],
)
def test_uneven_split_sizes_differ_by_at_most_one(size: int, chunks: int, sizes: list[int]) -> None:
    x = torch.arange(size)
    parts = microbatch.split((x, x.float()), chunks)
    assert [len(p[0]) for p in parts] == sizes
    assert [len(p[1]) for p in parts] == sizes
    merged = microbatch.merge(parts)
    assert torch.equal(merged[0], x)
    assert torch.equal(merged[1], x.float())


def test_split_returns_views_not_copies() -> None:
    x = torch.zeros(4, 2)
    parts = microbatch.split(x, 2)
    parts[1][0, 0] = 1.0
    assert x[2, 0] == 1.0


def test_merge_averages_scalars() -> None:
    losses = [torch.tensor(1.0), torch.tensor(3.0)]
    assert microbatch.merge(losses).item() == pytest.approx(2.0)
    counts = [torch.tensor(1), torch.tensor(2)]
    assert microbatch.merge(counts).item() == pytest.approx(1.5)  # integer scalars are averaged as floats
    out = microbatch.merge([{"loss": torch.tensor(2.0), "n": None}, {"loss": torch.tensor(4.0), "n": None}])
    assert out["loss"].item() == pytest.approx(3.0)
    assert out["n"] is None
    assert microbatch.merge([None, None]) is None


@pytest.mark.parametrize("chunks", [0, 5, -1])
def test_split_rejects_more_chunks_than_samples(chunks: int) -> None:
    with pytest.raises(ValueError) as info:
        microbatch.split(torch.zeros(4, 2), chunks)
    message = str(info.value)
    assert f"num_microbatches={chunks}" in message
    assert "batch of 4 samples" in message
    assert "between 1 and 4" in message


def test_split_rejects_mismatched_batch_dims() -> None:
    with pytest.raises(ValueError, match=r"disagree on the batch dimension \(\(3,\) vs 4 samples\)"):
        microbatch.split({"x": torch.zeros(4, 2), "y": torch.zeros(3)}, 2)
    with pytest.raises(ValueError, match="disagree on the batch dimension"):
        microbatch.split((torch.zeros(4), torch.tensor(1.0)), 2)


def test_split_rejects_batches_without_tensors() -> None:
    with pytest.raises(TypeError, match="holds no tensor \\(got dict\\)"):
        microbatch.split({"names": ["a", "b"]}, 1)
    with pytest.raises(TypeError, match="holds no tensor \\(got list\\)"):
        microbatch.batch_size([1, 2, 3])


def test_split_rejects_a_scalar_first_leaf() -> None:
    with pytest.raises(ValueError, match="0-dim tensor"):
        microbatch.split({"scale": torch.tensor(2.0), "x": torch.zeros(4)}, 2)


def test_batch_size_uses_the_first_tensor() -> None:
    assert microbatch.batch_size({"a": "text", "b": (torch.zeros(5, 2), torch.zeros(7))}) == 5
    assert microbatch.batch_size(torch.zeros(3)) == 3


def test_signature_changes_with_shape_and_dtype() -> None:
    x = torch.zeros(4, 3)
    base = microbatch.signature((x, torch.zeros(4, dtype=torch.int64)))
    assert base == (((4, 3), torch.float32), ((4,), torch.int64))
    assert microbatch.signature((torch.ones(4, 3), torch.ones(4, dtype=torch.int64))) == base  # values do not matter
    assert microbatch.signature((torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64))) != base
    assert microbatch.signature((torch.zeros(4, 3), torch.zeros(4, dtype=torch.int32))) != base
    assert microbatch.signature((x.double(), torch.zeros(4, dtype=torch.int64))) != base
    assert microbatch.signature((x,)) != base
    assert microbatch.signature({"label": "ignored", "x": x}) == (((4, 3), torch.float32),)
    hash(base)
    parts = microbatch.split(torch.zeros(7, 2), 3)
    assert [microbatch.signature(p) for p in parts] == [
        (((3, 2), torch.float32),),
        (((2, 2), torch.float32),),
        (((2, 2), torch.float32),),
    ]


def test_split_defaultdict() -> None:
    batch: defaultdict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(0))
    batch["x"] = torch.arange(4)
    parts = microbatch.split(batch, 2)
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert torch.equal(microbatch.merge(parts)["x"], batch["x"])


@pytest.mark.parametrize("name", list(_batches()))
def test_to_cpu_and_detached_keep_the_structure(name: str) -> None:
    batch = _batches()[name]
    _assert_same(microbatch.to_cpu(batch), batch)
    _assert_same(microbatch.detached(batch), batch)
    assert [t.data_ptr() for t in microbatch.tensors(microbatch.detached(batch))] == [
        t.data_ptr() for t in microbatch.tensors(batch)
    ]  # detached, not copied


def test_to_cpu_detaches_and_keeps_other_leaves() -> None:
    w = torch.ones(2, requires_grad=True)
    tag = object()
    out = microbatch.to_cpu({"y": w * 2, "tag": tag, "n": 3, "d": defaultdict(list, a=[w + 1])})
    assert not out["y"].requires_grad and out["y"].grad_fn is None and out["y"].device.type == "cpu"
    assert out["tag"] is tag and out["n"] == 3
    assert type(out["d"]) is defaultdict and out["d"].default_factory is list and not out["d"]["a"][0].requires_grad


def test_detached_with_requires_grad_makes_float_leaves_only() -> None:
    w = torch.ones(3, requires_grad=True)
    x, idx = microbatch.detached((w * 2, torch.arange(3)), requires_grad=True)
    assert x.requires_grad and x.is_leaf and x.grad_fn is None
    assert not idx.requires_grad
    x.sum().backward()
    assert w.grad is None and x.grad is not None  # the graph was cut


def test_tensors_lists_every_tensor_in_order() -> None:
    x, y = torch.zeros(1), torch.ones(1)
    found = microbatch.tensors({"a": [x, None], "b": Pair(y, 3)})
    assert len(found) == 2 and found[0] is x and found[1] is y
