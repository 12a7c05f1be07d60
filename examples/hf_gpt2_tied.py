"""A Hugging Face model with tied weights, pipelined over 2 CPU processes: ``GPT2LMHeadModel`` (a small random
config built here, nothing downloaded), its token embedding tied to the output head, cut into embedding, blocks and
head by a few wrappers.

    python examples/hf_gpt2_tied.py                   # 60 steps on the standard library's docstrings, loss printed
    python examples/hf_gpt2_tied.py --check           # 3 steps, then compare with one process (exits 1 if apart)

Needs ``pip install transformers``. The pattern: the module keeps the Hugging Face model (``self.gpt``, for its
``generate()`` later) and ``configure_pipeline()`` returns wrappers around its parts. The embedding (stage 0) and the
head (the last stage) share ``wte.weight``: the strategy keeps a copy on each and sums their gradients every step, so
the copies stay equal and the checkpoint holds one tensor under both names. The model is also reached through
``self.gpt``, a second path to the same layers: the setup log names it, and the checkpoint holds the trained weights
under both names. Attention is ``sdpa``, causal without a mask (what ``GPT2Model`` passes when nothing is padded);
the check compares the wrappers with ``GPT2LMHeadModel.forward`` before training.
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


class Embed(nn.Module):
    """Token plus position embeddings (``GPT2Model``'s first lines)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.transformer.wte, gpt.transformer.wpe, gpt.transformer.drop

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class Block(nn.Module):
    """One ``GPT2Block``, hidden states in and out (the block returns a tuple in some versions of transformers)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """The final norm and the output head, whose weight is ``wte``'s."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.transformer.ln_f, gpt.lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


def tiny_gpt2(vocab: int, block: int, tie: bool = True) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=block,
        n_embd=64,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


class HFGPT2(L.LightningModule):
    def __init__(self, vocab: int, block: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt = tiny_gpt2(vocab, block)  # kept whole, for generate(): a second path to the layers
        self.layers = nn.Sequential(Embed(self.gpt), *(Block(b) for b in self.gpt.transformer.h), Head(self.gpt))

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
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--check", action="store_true", help="train 3 steps and compare with one process")
    args = p.parse_args(argv)
    steps = 3 if args.check else args.steps
    lightning_avgpipe.share_cpu_threads(2)
    L.seed_everything(0, verbose=False)
    data, vocab = text_batches(32, 16 * steps)
    model = HFGPT2(vocab)
    initial = copy.deepcopy(model)
    with torch.no_grad():  # the wrappers are the Hugging Face model, causal mask included
        ids = data.tensors[0][:2]
        apart = (initial.gpt(ids).logits - initial.layers(ids)).abs().max().item()
    strategy = lightning_avgpipe.AvgPipeStrategy(num_microbatches=args.microbatches)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir="runs/hf_gpt2_tied",
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
    reference = initial.state_dict()
    worst = max((state[k] - v).abs().max().item() for k, v in reference.items())
    head = f"layers.{len(ref) - 1}.lm_head.weight"
    tied = torch.equal(state["layers.0.wte.weight"], state[head])
    both = torch.equal(state["gpt.transformer.wte.weight"], state["layers.0.wte.weight"])
    print(f"wrappers against GPT2LMHeadModel.forward before training: max |logits apart| = {apart:.2e}")
    print(f"max |pipelined - one process with accumulation| = {worst:.2e} over every weight, under every name")
    print(f"tied: embedding and head equal {tied}; gpt.* equal to layers.* {both}")
    ok = worst < 1e-5 and apart < 1e-5 and tied and both
    print("check: OK" if ok else "check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
