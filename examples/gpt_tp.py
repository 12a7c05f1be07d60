"""A GPT over 2 pipeline stages x 2 tensor-parallel shards (4 CPU processes), split by the default plan: attention by
whole heads (q, k and v of the fused projection column-wise, the output projection row-wise) and the MLP pair.

    python examples/gpt_tp.py                         # the char GPT's nanoGPT-style blocks, 30 steps, loss printed
    python examples/gpt_tp.py --model gpt2 --check    # Hugging Face GPT-2 (Conv1D layers); compare with one process
    python examples/gpt_tp.py --check --tensor-parallel-mode 2d   # 2 stages x a 2 x 2 grid (8 processes, SUMMA)

``--model char`` is ``examples/char_gpt.py``'s model (``qkv``, ``proj`` and an MLP in each block); ``--model gpt2``
needs ``pip install transformers`` (a small random config, its embedding and head tied across the stages, nothing
downloaded) and reuses ``hf_gpt2_tied.py``'s wrappers. No plan is given: the setup log lists what each stage split,
and an attention whose code reads its widths from its input (``C // self.n_head``) is left whole with a warning
instead of split wrongly.
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


def char_layers(vocab: int, block: int) -> tuple[nn.Module | None, nn.Sequential]:
    from char_gpt import GPTConfig, gpt_layers

    return None, gpt_layers(GPTConfig(vocab_size=vocab, block_size=block, n_layer=4, n_head=4, n_embd=64))


def gpt2_layers(vocab: int, block: int) -> tuple[nn.Module | None, nn.Sequential]:
    from hf_gpt2_tied import Block, Embed, Head, tiny_gpt2

    gpt = tiny_gpt2(vocab, block)  # the embedding (stage 0) and the head (stage 1) tied: summed on each shard
    return gpt, nn.Sequential(Embed(gpt), *(Block(b) for b in gpt.transformer.h), Head(gpt))


class GPT(L.LightningModule):
    def __init__(self, model: str, vocab: int, block: int = 32, sgd: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        whole, self.layers = (gpt2_layers if model == "gpt2" else char_layers)(vocab, block)
        if whole is not None:
            self.gpt = whole  # the Hugging Face model, kept whole (a second path to the layers)

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
        if self.hparams.sgd:  # the check: Adam would scale float noise in a near-zero gradient (a key bias's) to lr
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["char", "gpt2"], default="char")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--check", action="store_true", help="train 3 steps and compare with one process")
    p.add_argument("--sequence-parallel", action="store_true", help="norms and residuals on half the sequence each")
    p.add_argument(
        "--tensor-parallel-mode",
        choices=["1d", "2d", "2.5d"],
        default="1d",
        help="2d: each stage on a 2 x 2 grid (8 processes); 2.5d: one stage on 2 x 2 x 2 (8 processes)",
    )
    args = p.parse_args(argv)
    steps = 3 if args.check else args.steps
    lightning_avgpipe.share_cpu_threads(4)
    L.seed_everything(0, verbose=False)
    data, vocab = text_batches(32, 16 * steps)
    model = GPT(args.model, vocab, sgd=args.check)
    initial = copy.deepcopy(model)
    mode = args.tensor_parallel_mode
    T, devices = {"1d": (2, 4), "2d": (4, 8), "2.5d": (8, 8)}[mode]
    strategy = lightning_avgpipe.AvgPipeStrategy(
        num_microbatches=args.microbatches,
        tensor_parallel_size=T,
        sequence_parallel=args.sequence_parallel,
        tensor_parallel_mode=mode,
        tensor_parallel_depth=2 if mode == "2.5d" else 1,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=f"runs/gpt_tp_{args.model}",
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
    opt = initial.configure_optimizers()
    for ids, targets in loader:
        opt.zero_grad()
        for mi, mt in zip(ids.tensor_split(args.microbatches), targets.tensor_split(args.microbatches)):
            loss = F.cross_entropy(ref(mi).flatten(0, 1), mt.flatten()) * (len(mi) / len(ids))
            loss.backward()
        opt.step()
    worst = max((state[k] - v).abs().max().item() for k, v in initial.state_dict().items())
    print(f"max |pipelined and split - one process with accumulation| = {worst:.2e} over every weight")
    ok = worst < 1e-5  # float tolerance: a split matmul sums its halves in another order
    print("check: OK" if ok else "check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
