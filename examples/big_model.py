"""A pretrained Hugging Face Llama that no rank holds whole: built without memory in ``configure_model``, its weights
read per stage from a sharded safetensors checkpoint, saved as a folder every rank writes its part of.

    python examples/big_model.py            # 20 steps over 2 stages, a sharded checkpoint, then one file of it
    python examples/big_model.py --check    # 3 steps, then compare with from_pretrained on one process
    python examples/big_model.py --groups 2 --check   # D = 2 x S = 2 (4 ranks), each stage sharded (ZeRO-3)

Needs ``pip install transformers``. Nothing is downloaded: the script first saves a small random Llama with
``save_pretrained(max_shard_size=...)`` into ``runs/big_model/pretrained`` (several shards and an index, as a
downloaded checkpoint has), or takes ``--pretrained FOLDER`` of your own. Each rank reports the parameter bytes it
holds: its own stage's, never the whole model's; with ``--groups D`` (``sharding_strategy="FULL_SHARD"``, FSDP2 over
the D ranks of a stage) a 1/D shard of it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

import lightning_avgpipe  # registers strategy="avgpipe"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_llama_tp import Block, Embed, Head  # noqa: E402 - the same wrappers of Llama's parts
from rotary_tuple import text_batches  # noqa: E402 - the same windows of text


def save_random_llama(path: Path, vocab: int, block: int) -> None:
    """A stand-in for a downloaded checkpoint: a random Llama saved in shards (once; the other ranks find it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=block,
        tie_word_embeddings=True,  # the embedding on stage 0 and the head on stage 1 share one weight
    )
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    LlamaForCausalLM(config).save_pretrained(tmp, max_shard_size="100KB")
    tmp.rename(path)


def pipeline_of(llm: nn.Module) -> nn.Sequential:
    return nn.Sequential(Embed(llm), *(Block(b) for b in llm.model.layers), Head(llm))


class PretrainedLlama(L.LightningModule):
    def __init__(self, pretrained: str, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        """Under AvgPipe: on the meta device, recorded; each rank makes real, and reads from the files, only its
        own stage's weights. On one device: built and loaded here."""
        if hasattr(self, "llm"):
            return
        from transformers import AutoConfig, LlamaForCausalLM

        self.llm = LlamaForCausalLM(AutoConfig.from_pretrained(self.hparams.pretrained))
        lightning_avgpipe.load_pretrained(self.llm, self.hparams.pretrained)
        self.layers = pipeline_of(self.llm)

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
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def on_train_start(self) -> None:
        real = {id(p): p for p in self.parameters() if not p.is_meta}
        mine = sum(getattr(p, "to_local", lambda p=p: p)().nbytes for p in real.values())  # a shard: its local part
        print(f"rank {self.global_rank}: {mine / 1024:.0f} KiB of parameters held (its own stage's)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--pretrained", help="a Hugging Face Llama folder (default: a random one saved here)")
    p.add_argument("--root", default="runs/big_model")
    p.add_argument("--check", action="store_true", help="train 3 steps and compare with from_pretrained")
    p.add_argument("--groups", type=int, default=1, help="D pipeline groups of 2 stages, each stage sharded over D")
    p.add_argument("--sharding", default="FULL_SHARD", help="sharding_strategy with --groups > 1 (ZeRO-1, 2 or 3)")
    args = p.parse_args(argv)
    steps = 3 if args.check else args.steps
    lightning_avgpipe.share_cpu_threads(2)
    D = args.groups
    data, vocab = text_batches(32, 16 * D * steps)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    pretrained = Path(args.pretrained) if args.pretrained else root / "pretrained"
    if not args.pretrained:
        save_random_llama(pretrained, vocab, 32)
    # D > 1: one model over the D groups (exact averaging), each stage's weights, gradients and AdamW state sharded
    sharded = {"averaging": "exact", "sharding_strategy": args.sharding} if D > 1 else {}
    strategy = lightning_avgpipe.AvgPipeStrategy(
        num_stages=2,
        num_microbatches=args.microbatches,
        partition="parameters",
        save_distributed_checkpoint=True,
        **sharded,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2 * D,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        use_distributed_sampler=D == 1,  # D > 1: the sampler below, in order (Lightning's would shuffle)
    )
    # group d reads samples d, d + D, ... 16 a step: together one device's batch of 16 x D, in order
    group = DistributedSampler(data, num_replicas=D, rank=trainer.global_rank // 2, shuffle=False) if D > 1 else None
    loader = DataLoader(data, batch_size=16, sampler=group)
    trainer.fit(PretrainedLlama(str(pretrained)), loader)
    folder = root / "final.ckpt"
    trainer.save_checkpoint(folder)  # every rank writes its own stage's part
    if not trainer.is_global_zero:
        return 0
    lightning_avgpipe.consolidate(folder, root / "final-one-file.ckpt")  # tensor by tensor
    print(f"saved {folder} (a folder per rank's part) and {root / 'final-one-file.ckpt'}")
    print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")
    if not args.check:
        return 0
    from transformers import LlamaForCausalLM

    llm = LlamaForCausalLM.from_pretrained(pretrained)  # one process, accumulation over the same micro-batches
    ref = pipeline_of(llm)
    opt = torch.optim.AdamW(llm.parameters(), lr=3e-3)
    for ids, targets in DataLoader(data, batch_size=16 * D):
        opt.zero_grad()
        for mi, mt in zip(ids.tensor_split(args.microbatches), targets.tensor_split(args.microbatches)):
            loss = F.cross_entropy(ref(mi).flatten(0, 1), mt.flatten()) * (len(mi) / len(ids))
            loss.backward()
        opt.step()
    state = torch.load(root / "final-one-file.ckpt", weights_only=True)["state_dict"]
    worst = max((state[f"llm.{k}"] - v).abs().max().item() for k, v in llm.state_dict().items())
    print(f"max |per-stage load, pipelined - from_pretrained, one process with accumulation| = {worst:.2e}")
    ok = worst < 5e-5
    print("check: OK" if ok else "check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
