"""Pure units for the metadata half of ``lightning_avgpipe.runtime.comms.p2p``: OutputMeta and flatten_output (no
process group; the transfers themselves are covered by the multi-process equivalence tests)."""

from __future__ import annotations

import pytest
import torch

from lightning_avgpipe.runtime.comms.p2p import META_LEN, OutputMeta, StageOutputError, TensorMeta, flatten_output

CPU = torch.device("cpu")


def _round_trip(meta: OutputMeta) -> OutputMeta:
    buf = meta.encode(CPU)
    assert buf.dtype == torch.int64
    assert buf.shape == (META_LEN,)
    return OutputMeta.decode(buf)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    ],
)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (1, 2, 3, 4)])
def test_single_tensor_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = torch.zeros(shape, dtype=dtype)
    requires_grad = dtype.is_floating_point or dtype.is_complex
    if requires_grad:
        t.requires_grad_(True)
    meta = OutputMeta.of(t, "stage 0")
    assert meta == OutputMeta(False, (TensorMeta(dtype, shape, requires_grad),))
    assert _round_trip(meta) == meta


def test_tuple_of_mixed_tensors_round_trip() -> None:
    value = (
        torch.randn(4, 8, requires_grad=True),
        torch.zeros(4, 8, dtype=torch.bfloat16),
        torch.ones(4, dtype=torch.bool),
        torch.arange(4, dtype=torch.int64),
        torch.tensor(3.5, dtype=torch.float64, requires_grad=True),  # 0-dim
        torch.zeros(0, 7, dtype=torch.float16),
    )
    meta = OutputMeta.of(value, "stage 1")
    assert meta.is_tuple
    assert [(m.dtype, m.shape, m.requires_grad) for m in meta.tensors] == [
        (torch.float32, (4, 8), True),
        (torch.bfloat16, (4, 8), False),
        (torch.bool, (4,), False),
        (torch.int64, (4,), False),
        (torch.float64, (), True),
        (torch.float16, (0, 7), False),
    ]
    assert _round_trip(meta) == meta


def test_a_list_output_travels_as_a_tuple_and_a_one_tuple_stays_a_tuple() -> None:
    t = torch.zeros(2)
    assert OutputMeta.of([t, t], "stage 0").is_tuple
    one = OutputMeta.of((t,), "stage 0")
    assert one.is_tuple and _round_trip(one).is_tuple
    assert not _round_trip(OutputMeta.of(t, "stage 0")).is_tuple


def test_header_layout() -> None:
    meta = OutputMeta.of((torch.zeros(2, 3), torch.tensor(True)), "stage 0")
    values = meta.encode(CPU).tolist()
    # is_tuple, count, then per tensor: dtype index, requires_grad, ndim, *shape; padded with -1.
    assert values[:10] == [1, 2, 0, 0, 2, 2, 3, 9, 0, 0]
    assert values[10:] == [-1] * (META_LEN - 10)


def test_the_largest_header_that_fits() -> None:
    # 2 + 62 * (3 + 1) + 2 * 3 = 256 slots exactly.
    value = tuple(torch.zeros(1) for _ in range(62)) + (torch.tensor(0.0), torch.tensor(1.0))
    meta = OutputMeta.of(value, "stage 0")
    assert _round_trip(meta) == meta


def test_too_many_tensors_raise() -> None:
    value = tuple(torch.zeros(1) for _ in range(63)) + (torch.tensor(0.0),)  # 257 slots
    meta = OutputMeta.of(value, "stage 0")
    with pytest.raises(StageOutputError, match=f"64 tensors needs 257 metadata slots, more than {META_LEN}"):
        meta.encode(CPU)
    assert issubclass(StageOutputError, TypeError)


def test_flatten_output_accepts_tensors_and_tuples_of_tensors() -> None:
    a, b = torch.zeros(2), torch.ones(3)
    assert flatten_output(a, "stage 0") == [a]
    out = flatten_output((a, b), "stage 0")
    assert len(out) == 2 and out[0] is a and out[1] is b
    assert flatten_output([a], "stage 0")[0] is a


@pytest.mark.parametrize(
    ("value", "what"),
    [
        ({"h": torch.zeros(2)}, "returned dict;"),
        (None, "returned NoneType;"),
        ([1, "a"], "returned list of int, str;"),
        ((torch.zeros(2), 3), "returned tuple of Tensor, int;"),
        ((), "returned tuple (empty);"),
        ([], "returned list (empty);"),
        (3.0, "returned float;"),
    ],
)
def test_flatten_output_rejects_what_cannot_travel(value: object, what: str) -> None:
    where = "stage 2 (the last layer before the cut)"
    with pytest.raises(StageOutputError) as info:
        flatten_output(value, where)
    message = str(info.value)
    assert message.startswith(where + " " + what), message
    assert "tensor or a tuple of tensors" in message
    with pytest.raises(StageOutputError, match="stage 2"):
        OutputMeta.of(value, where)


def test_posting_to_a_gone_neighbour_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the neighbour is already dead, gloo fails at posting (not at waiting): named all the same."""
    import torch.distributed as dist

    from lightning_avgpipe.runtime.comms.p2p import Link, PeerFailureError

    def gone(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33005.")

    monkeypatch.setattr(dist, "irecv", gone)
    monkeypatch.setattr(dist, "isend", gone)
    link = Link(0, 2, torch.device("cpu"), name="stage 1 (rank 1)", stage=1)
    with pytest.raises(
        PeerFailureError,
        match=r"stage 1 \(rank 1\): a transfer \(receive\) from rank 0 \(stage 0\) "
        r"did not arrive: that rank failed.*Connection closed by peer",
    ):
        link._p2p(False, torch.zeros(2), 0)
    with pytest.raises(PeerFailureError, match=r"a transfer \(send\) from rank 2 \(stage 2\) did not arrive"):
        link._p2p(True, torch.zeros(2), 2)
