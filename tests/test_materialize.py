"""A model built without memory: recorded on the meta device, each rank makes only its own layers
real by replaying the build, with one process's values bit for bit, for every layout."""

from __future__ import annotations

import tempfile
from itertools import combinations
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_avgpipe.runtime.build.init_record import InitRecord
from lightning_avgpipe.runtime.build.materialize import is_meta_module, materialize


class Block(nn.Module):
    """Layers initialized by their own ``reset_parameters`` (LayerNorm, MultiheadAttention, Linear), a buffer
    computed from a factory, and a parameter drawn by ``torch.randn``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2)
        self.fc = nn.Linear(d, d)
        self.register_buffer("pos", torch.arange(8).float().cos())
        self.scale = nn.Parameter(torch.randn(d))


def build() -> nn.Sequential:
    """Six layers; the head tied to the embedding (two stages share it); a nanoGPT-style custom init
    (``apply(_init_weights)``, ``weight.data.normal_``) and initializers that skip meta tensors themselves."""
    m = nn.Sequential(nn.Embedding(20, 8), Block(8), nn.Conv1d(8, 8, 3), Block(8), nn.BatchNorm1d(8), nn.Linear(8, 20))
    m[5].weight = m[0].weight

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0, 0.02)
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding):
            module.weight.data.normal_(0, 0.02)

    m.apply(init)
    nn.init.trunc_normal_(m[1].fc.weight, std=0.02)
    nn.init.orthogonal_(m[3].fc.weight)
    return m


def _owned(m: nn.Module, layers: set[int]) -> set[int]:
    return {id(t) for i in layers for t in [*m[i].parameters(), *m[i].buffers()]}


def _recorded(seed: int = 3) -> tuple[nn.Sequential, InitRecord]:
    torch.manual_seed(seed)
    with torch.device("meta"), InitRecord() as record:
        meta = build()
    return meta, record


LAYOUTS = [set(c) for n in (1, 2, 3) for c in combinations(range(6), n)]


def test_every_layout_gets_one_processs_values_bit_for_bit_and_only_its_own_bytes() -> None:
    """Each subset of the six layers (a rank's stages under some layout) made real: equal to the whole model built
    in one process from the same seed, bit for bit; the random generator afterwards where that build left it; the
    bytes made real those of the subset alone; at most one layer's tensors of the others alive at once."""
    torch.manual_seed(3)
    whole = build()
    after_whole = torch.rand(4)
    expected = whole.state_dict()
    largest_layer = max(sum(t.nbytes for t in [*layer.parameters(), *layer.buffers()]) for layer in whole)
    for owned in LAYOUTS:
        meta, record = _recorded()
        ids = _owned(meta, owned)
        report = materialize(meta, lambda t, ids=ids: id(t) in ids, record, torch.device("cpu"))
        assert torch.equal(torch.rand(4), after_whole), owned
        state = meta.state_dict(keep_vars=True)
        real = {k: v for k, v in state.items() if not v.is_meta}
        tied = {"0.weight", "5.weight"} if owned & {0, 5} else set()  # one tensor, real where either layer is
        want = {k for k in expected if int(k.split(".")[0]) in owned} | tied
        assert set(real) == want, owned
        assert all(torch.equal(real[k], expected[k]) for k in real), owned
        share = {id(t): t for i in owned for t in [*whole[i].parameters(), *whole[i].buffers()]}
        assert report.kept_bytes == sum(t.nbytes for t in share.values()), owned
        assert report.peak_other_bytes <= 2 * largest_layer, (owned, report.peak_other_bytes, largest_layer)
        assert report.uninitialized == [] and not report.rng_moved
        if {0, 5} <= owned:
            assert meta[5].weight is meta[0].weight  # the tie holds: one real tensor under both names


def test_a_parameter_no_call_gave_values_and_draws_between_build_and_setup_are_reported() -> None:
    torch.manual_seed(0)
    with torch.device("meta"), InitRecord() as record:
        m = nn.Linear(3, 2)
        m.extra = nn.Parameter(torch.empty(5))  # what torch.empty gave, on one process too
    torch.rand(1)  # the generator used between the build and the replay
    report = materialize(m, lambda t: True, record, torch.device("cpu"))
    assert report.uninitialized == ["extra"]
    assert report.rng_moved
    assert not is_meta_module(m)
    torch.manual_seed(0)
    assert torch.equal(m.weight, nn.Linear(3, 2).weight)  # the kept values are still one process's


def test_a_build_that_seeds_itself_is_replayed_with_its_seed() -> None:
    torch.manual_seed(123)
    with torch.device("meta"), InitRecord() as record:
        torch.manual_seed(7)
        m = nn.Linear(4, 4)
    report = materialize(m, lambda t: True, record, torch.device("cpu"))
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(m.weight, nn.Linear(4, 4).weight) and not report.rng_moved
    assert torch.equal(torch.rand(3), after)  # the draws after the build: as after the real one


def _one_process(fn):  # type: ignore[no-untyped-def]
    """``fn()`` built for real, and the generator's next draws after it."""
    torch.manual_seed(5)
    built = fn()
    return built, torch.rand(3)


def _replayed(fn, keep=lambda t: True):  # type: ignore[no-untyped-def]
    torch.manual_seed(5)
    with torch.device("meta"), InitRecord() as record:
        built = fn()
    report = materialize(built, keep, record, torch.device("cpu"))
    return built, torch.rand(3), report


def _equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "case", ["to-bf16", "transpose-after-init", "late-read", "positional-meta", "fork-rng", "graph-in-build"]
)
def test_builds_that_change_or_read_their_tensors_replay_exactly(case: str) -> None:
    """What a build does to its tensors after creating them (a dtype change through ``.data =``, an in-place
    transpose, a no-op ``.to`` over everything, a device passed positionally, a forked generator, an autograd graph
    over parameters) replays as it was: the same values and the same generator afterwards."""

    def build() -> nn.Module:
        m = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
        if case == "to-bf16":
            m.to(torch.bfloat16)
        elif case == "transpose-after-init":
            with torch.no_grad():
                m[2].weight.normal_()
                m[2].weight.t_()
        elif case == "late-read":
            m.to(torch.float32)  # a no-op over every parameter, at the end
            assert all(p.is_contiguous() for p in m.parameters())
        elif case == "positional-meta":
            m.register_buffer("halves", torch.ones(4).to(m[0].weight.device, torch.float16))
        elif case == "fork-rng":
            with torch.random.fork_rng(devices=[]):
                torch.rand(7)
            m.append(nn.Linear(32, 2))
        elif case == "graph-in-build":
            (m[0].weight * m[1].weight).sum()
        return m

    whole, after = _one_process(build)
    own = {0, 3}
    replayed, after_replay, report = _replayed(build, lambda t, m=None: True)
    assert _equal(whole, replayed) and torch.equal(after, after_replay), case
    if case == "late-read":  # the late no-op read does not keep other layers alive: one layer at a time
        torch.manual_seed(5)
        with torch.device("meta"), InitRecord() as record:
            m = build()
        ids = {id(t) for i in own for t in m[i].parameters()}
        partial = materialize(m, lambda t: id(t) in ids, record, torch.device("cpu"))
        layer = 32 * 32 * 4 + 32 * 4
        assert partial.peak_other_bytes <= layer, (partial.peak_other_bytes, layer)
        assert not report.uninitialized


def test_two_builds_an_init_module_block_then_configure_model() -> None:
    """Two records (a module built under ``trainer.init_module()``, then more in ``configure_model``): each gives
    its own tensors their values; the generator ends where the two real builds left it."""
    torch.manual_seed(5)
    a = nn.Linear(8, 8)
    b = nn.Linear(8, 8)
    after = torch.rand(3)
    torch.manual_seed(5)
    holder = nn.Module()
    with torch.device("meta"), InitRecord() as first:
        holder.a = nn.Linear(8, 8)
    with torch.device("meta"), InitRecord() as second:
        holder.b = nn.Linear(8, 8)
    report = materialize(holder, lambda t: True, [first, second], torch.device("cpu"))
    assert report.uninitialized == [] and not report.rng_moved
    assert torch.equal(holder.a.weight, a.weight) and torch.equal(holder.b.weight, b.weight)
    assert torch.equal(torch.rand(3), after)


def test_a_parameter_keeps_its_class_and_attributes_and_an_alias_of_a_buffer_follows_it() -> None:
    class Tagged(nn.Parameter):
        pass

    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", torch.arange(4).float(), persistent=False)
            self.original_inv_freq = self.inv_freq  # as Hugging Face's rotary embeddings keep it
            self.w = Tagged(torch.randn(3))
            self.w._no_weight_decay = True
            self.register_buffer("scale", torch.ones(3, device="cpu"))  # a real tensor changed in the build
            self.scale.mul_(2)

    (whole, _), (replayed, _, _) = _one_process(Rotary), _replayed(Rotary)
    assert type(replayed.w) is Tagged and replayed.w._no_weight_decay
    assert torch.equal(replayed.w, whole.w) and not replayed.original_inv_freq.is_meta
    assert torch.equal(replayed.original_inv_freq, whole.original_inv_freq)
    assert torch.equal(replayed.scale, torch.full((3,), 2.0))  # changed once, in the build: not again


def test_the_forward_check_runs_on_the_meta_device_by_shapes() -> None:
    """A model never whole in any process: ``forward`` and the layers are compared on meta tensors (shapes and
    dtypes); a forward that adds a layer the pipeline lacks is still refused."""
    from lightning_avgpipe.errors import PipelineContractError
    from lightning_avgpipe.plugin.split.stages import check_forward_of

    class Net(nn.Module):
        def __init__(self, extra: bool) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            self.extra = nn.Linear(2, 3) if extra else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.layers(x)
            return self.extra(y) if self.extra is not None else y

    sample = torch.randn(2, 4)
    for extra in (False, True):
        with torch.device("meta"):
            net = Net(extra)
        if extra:
            with pytest.raises(PipelineContractError, match=r"forward gives float32 \(2, 3\), the layers give"):
                check_forward_of(net, list(net.layers), sample, deferred=True)
        else:
            assert "shapes and dtypes only" in str(check_forward_of(net, list(net.layers), sample, deferred=True))


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "partition"), [(2, [2, 4]), (3, [1, 3, 2])], ids=["S2", "S3"])
def test_a_model_built_in_configure_model_trains_as_one_device(devices: int, partition: list[int]) -> None:
    """LateNet builds its layers in ``configure_model``: under AvgPipe on the meta device, each rank then holding
    only its own layers' parameters and Adam state (counted), and training equals one process's to float tolerance."""
    from tests.helpers.equivalence import assert_matches, run_lightning
    from tests.helpers.models import make_layers

    out = Path(tempfile.mkdtemp())
    adam = {"optimizer": "adam", "lr": 0.01}
    results = run_lightning(
        out, devices, {"num_microbatches": 2, "partition": partition}, steps=4, late=True, model=adam
    )
    layers = make_layers()
    stage_of = [s for s, n in enumerate(partition) for _ in range(n)]
    for r in results:
        own = sum(p.numel() for layer, s in zip(layers, stage_of) if s == r["place"][2] for p in layer.parameters())
        assert r["parameters"] == own, (r["rank"], r["parameters"], own)
        assert r["optimizer_elements"] == 2 * own, (r["rank"], r["optimizer_elements"], own)  # Adam's two moments
    assert "the model was built without memory" in results[0]["output"], results[0]["output"][-2000:]
    assert "the forward check compared shapes and dtypes only (on the meta device)" in results[0]["output"]
    assert_matches(out, results, 2, **adam)


@pytest.mark.slow
def test_a_model_built_in_configure_model_splits_by_a_tensor_parallel_plan() -> None:
    """T = 2 on one stage: the plan splits the layers on the meta device, each rank makes only its shards real (counted
    after the run), and training equals one process's."""
    from tests.helpers.checkpoints import TP_PLAN
    from tests.helpers.equivalence import assert_matches, run_lightning
    from tests.helpers.models import make_layers

    out = Path(tempfile.mkdtemp())
    strategy = {"num_stages": 1, "num_microbatches": 2, "tensor_parallel_size": 2, "tensor_parallel_plan": TP_PLAN}
    adam = {"optimizer": "adam", "lr": 0.01}
    results = run_lightning(out, 2, strategy, steps=4, late=True, model=adam)
    assert results[1]["sharded"] == ["layers.3.bias", "layers.3.weight", "layers.5.bias", "layers.5.weight"]
    assert "the model was built without memory" in results[0]["output"]
    # split on the meta device, then only each rank's shards made real: half of layers.3 and of layers.5's weight
    layers = make_layers()
    whole = sum(p.numel() for layer in layers for p in layer.parameters())
    halved = layers[3].weight.numel() + layers[3].bias.numel() + layers[5].weight.numel()
    assert [r["local_parameters"] for r in results] == [whole - halved // 2] * 2, [
        r["local_parameters"] for r in results
    ]
    assert_matches(out, results, 2, **adam)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_uniform_draws_over_other_ranks_layers_are_made_in_chunks_and_leave_the_generator_as_one_process(
    dtype: torch.dtype,
) -> None:
    """A uniform init over a layer this rank does not keep is drawn in chunks of a small buffer (a CPU uniform
    draws element by element): the kept layer after it, a normal init after that and a generator passed by
    argument get one process's values bit for bit, with less than one other layer's bytes alive."""
    generator = torch.Generator().manual_seed(7)

    def make() -> nn.Sequential:
        big = nn.Linear(700, 300, dtype=dtype)  # 210,000 weights: more than one chunk
        nn.init.xavier_uniform_(big.weight, generator=generator)
        tail = nn.Linear(300, 5, dtype=dtype)
        nn.init.normal_(tail.bias)
        return nn.Sequential(big, tail)

    torch.manual_seed(3)
    generator.manual_seed(7)
    whole = make()
    torch.manual_seed(3)
    generator.manual_seed(7)
    record = InitRecord()
    with torch.device("meta"), record:
        model = make()
    keep = {id(t) for t in model[1].parameters()}
    report = materialize(model, lambda t: id(t) in keep, record, torch.device("cpu"))
    for name, value in model[1].state_dict().items():
        assert torch.equal(value, whole[1].state_dict()[name]), name
    # the other layer's draws held one chunk of a buffer at most, never a tensor of its size
    assert model[0].weight.is_meta and 0 < report.peak_other_bytes < whole[0].weight.nbytes // 2
