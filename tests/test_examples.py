"""The worked examples for real models (docs/guide.md#worked-examples) run as scripts and check themselves."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, run_command

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_a_cnn_with_batchnorm_equals_accumulation_over_the_micro_batches(tmp_path: Path) -> None:
    """``examples/cnn_batchnorm.py --check``: 3 pipelined steps of a BatchNorm CNN equal one process with gradient
    accumulation over the same 4 micro-batches: every weight and running statistic, and num_batches_tracked = M x
    steps (BatchNorm updates once per micro-batch)."""
    out = run_command(
        [sys.executable, str(ROOT / "examples" / "cnn_batchnorm.py"), "--check", "--steps", "3"], tmp_path
    )
    assert "check: OK" in out, out[-3000:]
    worst = float(re.search(r"max \|pipelined - one process .*?\| = ([0-9.e+-]+)", out).group(1))  # type: ignore[union-attr]
    assert worst < 1e-5
    assert "(M x steps = 12)" in out and "'0.2.num_batches_tracked': 12" in out


@pytest.mark.timeout(300)
def test_blocks_that_carry_a_rotary_cache_and_a_mask_in_a_tuple(tmp_path: Path) -> None:
    """``examples/rotary_tuple.py --check``: blocks taking ``(x, cos, sin, mask)`` and returning it, cut over 2
    stages (the boolean mask and the cache cross as they are), train as one process with accumulation does."""
    out = run_command([sys.executable, str(ROOT / "examples" / "rotary_tuple.py"), "--check"], tmp_path)
    assert "check: OK" in out, out[-3000:]
    assert float(re.search(r"accumulation\| = ([0-9.e+-]+)", out).group(1)) < 1e-5  # type: ignore[union-attr]


@pytest.mark.timeout(300)
def test_a_hugging_face_gpt2_with_tied_weights(tmp_path: Path) -> None:
    """``examples/hf_gpt2_tied.py --check``: GPT2LMHeadModel (random tiny config) through wrappers equals its own
    forward, trains over 2 stages as one process with accumulation does, keeps wte and lm_head one tensor, and
    checkpoints the trained weights under its second path (``gpt.*``) too."""
    pytest.importorskip("transformers")
    out = run_command([sys.executable, str(ROOT / "examples" / "hf_gpt2_tied.py"), "--check"], tmp_path)
    assert "check: OK" in out, out[-3000:]
    assert float(re.search(r"accumulation\| = ([0-9.e+-]+)", out).group(1)) < 1e-5  # type: ignore[union-attr]
    assert "tied: embedding and head equal True; gpt.* equal to layers.* True" in out
    assert "reaches layers of the pipeline by a second path: gpt.transformer.wte is layers.0.wte" in out, out[-3000:]


@pytest.mark.timeout(420)
def test_a_hugging_face_llama_split_by_its_own_tensor_parallel_plan(tmp_path: Path) -> None:
    """``examples/hf_llama_tp.py --check --sequence-parallel``: LlamaForCausalLM (random tiny config) over 2 stages x
    2 shards, with no plan given: the strategy follows the model's config.base_model_tp_plan (q, k, v, o, gate, up,
    down of every block, on both stages), every block holds half the sequence (the attention gathers it), the cut
    is crossed as each shard's part, and it trains as one process with accumulation does. (Without sequence
    parallelism, and on a grid: the next test.)"""
    pytest.importorskip("transformers")
    out = run_command(
        [sys.executable, str(ROOT / "examples" / "hf_llama_tp.py"), "--check", "--sequence-parallel"], tmp_path
    )
    assert "check: OK" in out, out[-3000:]
    said = (
        "stage 0: 1 (layer.self_attn whole), 2 (layer.self_attn whole) of its 3, its output sent as each shard's part;"
    )
    assert said in " ".join(out.split()), out[-3000:]
    assert "tensor parallelism follows the Hugging Face model's config.base_model_tp_plan" in out
    split = out.split("splits, per stage, ")[1].split("\n")[0]
    for stage, block in ((0, 1), (1, 3)):
        names = [f"layers.{block}.layer.{m}" for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]
        assert f"stage {stage}: " in split and all(n in split for n in names), split


@pytest.mark.timeout(420)
@pytest.mark.parametrize("flags", [[], ["--grid"]], ids=["torch-styles", "grid"])
def test_a_hugging_face_llama_on_torchs_styles_and_on_a_grid(tmp_path: Path, flags: list[str]) -> None:
    """``examples/hf_llama_tp.py --check``, without sequence parallelism: the model's own plan on torch's Colwise and
    Rowwise styles (2 stages x 2 shards), and ``--grid``: each stage on a 2 x 2 SUMMA grid (8 processes). Both train
    as one process with accumulation does."""
    pytest.importorskip("transformers")
    out = run_command([sys.executable, str(ROOT / "examples" / "hf_llama_tp.py"), "--check", *flags], tmp_path)
    assert "check: OK" in out, out[-3000:]
    worst = float(re.search(r"one process with accumulation\| = ([0-9.e+-]+)", out).group(1))  # type: ignore[union-attr]
    assert worst < 5e-5
    said = " ".join(out.split())
    crossing = "2 (layer.self_attn whole) of its 3, its output sent as each shard's part"
    if flags:  # the grid: both blocks of stage 0 converted, their attention whole; the cut crosses as blocks
        assert "tensor_parallel_mode='2d': layers on 1 x 2 x 2 blocks" in said and crossing in said, out[-3000:]
    else:  # 1D on torch's styles: the plan followed, the cut sent whole
        assert "tensor parallelism follows the Hugging Face model's config.base_model_tp_plan" in out
        assert "layers on 1 x 2 x 2" not in said and "each shard's part" not in said, out[-3000:]


@pytest.mark.timeout(300)
# GPT-2 runs with sequence parallelism only: the same default plan, its stage lines and its check, in one launch
@pytest.mark.parametrize("model", ["char", "gpt2-sequence-parallel"])
def test_a_gpt_split_by_heads_with_the_default_plan(tmp_path: Path, model: str) -> None:
    """``examples/gpt_tp.py --check``: over 2 stages x 2 shards with no plan given, the char GPT's nanoGPT-style blocks
    (fused ``qkv``, ``proj``, MLP) and Hugging Face GPT-2's (Conv1D ``c_attn``, ``c_proj``, ``c_fc``) are split by
    heads and MLP pairs on both stages, and train as one process with accumulation does; GPT-2's (its embedding and
    head tied across the stages) with sequence parallelism, every block on half the sequence (its attention on the
    whole), the cut crossed as each shard's part."""
    sequence = model.endswith("-sequence-parallel")
    model = model.removesuffix("-sequence-parallel")
    if model == "gpt2":
        pytest.importorskip("transformers")
    command = [sys.executable, str(ROOT / "examples" / "gpt_tp.py"), "--model", model, "--check"]
    out = run_command(command + (["--sequence-parallel"] if sequence else []), tmp_path)
    if sequence:
        said = "stage 0: 1 (block.attn whole), 2 (block.attn whole) of its 3, its output sent as each shard's part; "
        said += "stage 1: 0 (block.attn whole)"
        assert said in " ".join(out.split()), out[-3000:]
    assert "check: OK" in out, out[-3000:]
    assert float(re.search(r"accumulation\| = ([0-9.e+-]+)", out).group(1)) < 1e-5  # type: ignore[union-attr]
    split = out.split("splits, per stage, ")[1].split("\n")[0]
    parts = ("", ".mlp.0", ".mlp.2") if model == "char" else (".block.attn", ".block.mlp.c_fc", ".block.mlp.c_proj")
    for stage, block in ((0, 1), (1, 4)):
        assert f"stage {stage}: " in split and all(f"layers.{block}{p}" in split for p in parts), split
    assert "left attention whole" not in out


@pytest.mark.timeout(300)
def test_a_hugging_face_gpt2_on_two_stages_of_a_two_by_two_grid(tmp_path: Path) -> None:
    """``examples/gpt_tp.py --model gpt2 --check --tensor-parallel-mode 2d`` (8 processes): through the strategy, each
    stage's GPT-2 blocks on a 2 x 2 grid (SUMMA, norms over the grid row, attention split by heads over the 4 ranks),
    the tied embedding and head left whole and said why, train as one process with accumulation does."""
    pytest.importorskip("transformers")
    command = [sys.executable, str(ROOT / "examples" / "gpt_tp.py"), "--model", "gpt2", "--check"]
    out = " ".join(run_command([*command, "--tensor-parallel-mode", "2d"], tmp_path).split())
    assert "check: OK" in out, out[-3000:]
    assert float(re.search(r"accumulation\| = ([0-9.e+-]+)", out).group(1)) < 1e-5  # type: ignore[union-attr]
    # the embedding and the head are tied across the stages: each stays whole, its gradient summed on each shard
    said = "stage 0: 1 (block.attn by heads), 2 (block.attn by heads) of its 3, its output sent as each shard's part; "
    said += "its layer 0 whole: its weight "
    said += "'wte.weight' is tied to another stage's, which holds it whole | stage 1: 0 (block.attn by heads), 1 "
    assert "tensor_parallel_mode='2d': layers on 1 x 2 x 2 blocks" in out and said in out, out[-3000:]


@pytest.mark.timeout(300)
def test_a_hugging_face_llama_with_a_lora_adapter_is_whole_after_fit_and_saves_every_tensor(tmp_path: Path) -> None:
    """``examples/peft_lora.py --check``: a PEFT LoRA adapter on a Llama over 2 stages; after
    ``fit`` the launching process's module is the whole trained model, so ``save_pretrained`` writes all 16 LoRA
    tensors, equal to one process's training with accumulation."""
    pytest.importorskip("peft")
    out = run_command(
        [sys.executable, str(ROOT / "examples" / "peft_lora.py"), "--check", "--root", str(tmp_path)], tmp_path
    )
    assert "check: OK" in out and "16 LoRA tensors" in out, out[-3000:]


@pytest.mark.timeout(300)
def test_a_hugging_face_llama_built_per_stage_and_loaded_from_its_shards(tmp_path: Path) -> None:
    """``examples/big_model.py --check``: a tied LlamaForCausalLM saved in shards, built on the meta device in
    configure_model and loaded with load_pretrained over 2 stages (each rank making real and reading only its own
    stage's weights), trained and saved as a folder, consolidated, equals from_pretrained on one process with
    accumulation."""
    pytest.importorskip("transformers")
    out = run_command(
        [sys.executable, str(ROOT / "examples" / "big_model.py"), "--check", "--root", str(tmp_path)], tmp_path
    )
    assert "check: OK" in out, out[-3000:]
    total = float(re.search(r"rank 0: [0-9.]+ KiB of ([0-9.]+) KiB", out).group(1))  # type: ignore[union-attr]
    made = {int(r): int(kib) for r, kib in re.findall(r"rank (\d): (\d+) KiB of parameters held", out)}
    assert made.keys() == {0, 1} and all(kib < 0.6 * total for kib in made.values()), (made, total)
    assert (tmp_path / "final.ckpt" / "avgpipe.pt").exists() and (tmp_path / "final-one-file.ckpt").is_file()


@pytest.mark.timeout(400)
def test_a_hugging_face_llama_sharded_over_two_groups_of_two_stages(tmp_path: Path) -> None:
    """``examples/big_model.py --groups 2 --check``: the same Llama at D = 2 x S = 2 (4 ranks) under FULL_SHARD,
    each rank holding about a quarter of the model (half of its stage), equals from_pretrained on one process
    training on both groups' batches at once."""
    pytest.importorskip("transformers")
    command = [sys.executable, str(ROOT / "examples" / "big_model.py"), "--groups", "2", "--check"]
    out = run_command([*command, "--root", str(tmp_path)], tmp_path)
    assert "check: OK" in out, out[-3000:]
    setup = re.search(r"rank 0: ([0-9.]+) KiB of ([0-9.]+) KiB, .*at most ([0-9.]+) KiB of other", out)
    assert setup is not None, out[-3000:]
    made, total, other = (float(setup.group(i)) for i in (1, 2, 3))
    # setup made real only rank 0's shard of its stage (sharded on the meta device), one whole tensor at a time
    assert made < 0.3 * total and other < 0.1 * total, (made, other, total)
    held = {int(r): int(kib) for r, kib in re.findall(r"rank (\d): (\d+) KiB of parameters held", out)}
    assert held.keys() == {0, 1, 2, 3} and all(kib < 0.3 * total for kib in held.values()), (held, total)
