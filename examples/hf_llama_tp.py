"""A Hugging Face Llama over 2 pipeline stages x 2 tensor-parallel shards (4 CPU processes), split as the model's own
``config.base_model_tp_plan`` says: q, k, v, gate and up column-wise, o and down row-wise (whole heads per shard).

    python examples/hf_llama_tp.py                    # 30 steps on the standard library's docstrings, loss printed
    python examples/hf_llama_tp.py --check            # 3 steps, then compare with one process (exits 1 if apart)
    python examples/hf_llama_tp.py --check --grid     # 2D: 2 stages x a 2 x 2 grid (8 processes)

Needs ``pip install transformers`` (a small random config built here, nothing downloaded). The module keeps the model
(``self.llm``) and ``configure_pipeline()`` returns wrappers: the embedding also makes the rotary cache, which every
block takes in a tuple (as ``examples/rotary_tuple.py`` carries it), and the head is the final norm and ``lm_head``.
With no ``tensor_parallel_plan``, the strategy finds the Hugging Face model and follows its plan.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_avgpipe  # registers strategy="avgpipe"

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from rotary_tuple import text_batches  # noqa: E402 - the same windows of text

Carry = tuple[Tensor, Tensor, Tensor]  # (hidden states, cos, sin)


class Embed(nn.Module):
    def __init__(self, llm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens, self.rotary_emb = llm.model.embed_tokens, llm.model.rotary_emb

    def forward(self, ids: Tensor) -> Carry:
        x = self.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        cos, sin = self.rotary_emb(x, positions)
        return x, cos, sin


class Block(nn.Module):
    """One ``LlamaDecoderLayer`` on the carried tuple (causal attention: sdpa without a mask)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, carry: Carry) -> Carry:
        x, cos, sin = carry
        out = self.layer(x, position_embeddings=(cos, sin))
        return (out[0] if isinstance(out, tuple) else out), cos, sin


class Head(nn.Module):
    def __init__(self, llm: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = llm.model.norm, llm.lm_head

    def forward(self, carry: Carry) -> Tensor:
        return self.lm_head(self.norm(carry[0]))


def tiny_llama(vocab: int, block: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=block,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


class HFLlama(L.LightningModule):
    def __init__(self, vocab: int, block: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.llm = tiny_llama(vocab, block)
        self.layers = nn.Sequential(Embed(self.llm), *(Block(b) for b in self.llm.model.layers), Head(self.llm))

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, ids: Tensor) -> Tensor:
        return self.layers(ids)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, targets = batch
        loss = F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--check", action="store_true", help="train 3 steps and compare with one process")
    p.add_argument("--sequence-parallel", action="store_true", help="norms and residuals on half the sequence each")
    p.add_argument("--grid", action="store_true", help="2D: each stage on a 2 x 2 grid (8 processes, SUMMA)")
    args = p.parse_args(argv)
    steps = 3 if args.check else args.steps
    lightning_avgpipe.share_cpu_threads(4)
    L.seed_everything(0, verbose=False)
    data, vocab = text_batches(32, 16 * steps)
    model = HFLlama(vocab)
    initial = copy.deepcopy(model)
    with torch.no_grad():  # the wrappers are the Hugging Face model
        ids = data.tensors[0][:2]
        apart = (initial.llm(ids).logits - initial.layers(ids)).abs().max().item()
    strategy = lightning_avgpipe.AvgPipeStrategy(
        num_microbatches=args.microbatches,
        tensor_parallel_size=4 if args.grid else 2,
        sequence_parallel=args.sequence_parallel,
        tensor_parallel_mode="2d" if args.grid else "1d",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=8 if args.grid else 4,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir="runs/hf_llama_tp",
    )
    loader = DataLoader(data, batch_size=16)  # one pipeline group reads it in order, as one device does
    trainer.fit(model, loader)
    state = strategy.lightning_module_state_dict()  # collective: the unsplit model's state dict on rank 0
    if not trainer.is_global_zero:
        return 0
    uniform = torch.log(torch.tensor(float(vocab))).item()
    print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f} (uniform guess: {uniform:.3f})")
    if not args.check:
        return 0
    ref = initial.layers  # one process, accumulation over the same micro-batches
    opt = torch.optim.AdamW(initial.parameters(), lr=3e-3)
    for ids, targets in loader:
        opt.zero_grad()
        for mi, mt in zip(ids.tensor_split(args.microbatches), targets.tensor_split(args.microbatches)):
            loss = F.cross_entropy(ref(mi).flatten(0, 1), mt.flatten()) * (len(mi) / len(ids))
            loss.backward()
        opt.step()
    worst = max((state[k] - v).abs().max().item() for k, v in initial.state_dict().items())
    print(f"wrappers against LlamaForCausalLM.forward before training: max |logits apart| = {apart:.2e}")
    print(f"max |pipelined and split - one process with accumulation| = {worst:.2e} over every weight")
    ok = worst < 5e-5 and apart < 1e-5  # float tolerance: a split matmul sums its halves in another order
    print("check: OK" if ok else "check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
