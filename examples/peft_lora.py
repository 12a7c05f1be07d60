"""A LoRA adapter (PEFT) on a Hugging Face Llama over 2 pipeline stages, saved with ``save_pretrained`` after ``fit``.

    python examples/peft_lora.py            # 20 steps on the standard library's docstrings, the adapter saved
    python examples/peft_lora.py --check    # 3 steps, then compare the saved adapter with one process's

Needs ``pip install transformers peft`` (a small random Llama built here, nothing downloaded). The module keeps the
PEFT model (``self.peft``) and ``configure_pipeline()`` returns wrappers around its parts. After ``fit`` the module
in the launching process holds the whole trained model again (the other stage's layers come back from its rank), so
``model.peft.save_pretrained(folder)`` writes every LoRA tensor there; on the other rank the module holds only its
own stage and refuses to save.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_avgpipe  # registers strategy="avgpipe"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_llama_tp import Block, Embed, Head, tiny_llama  # noqa: E402 - the same wrappers of Llama's parts
from rotary_tuple import text_batches  # noqa: E402 - the same windows of text


def with_lora(vocab: int, block: int, dropout: float) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "v_proj"])
    return get_peft_model(tiny_llama(vocab, block), config)


def pipeline_of(peft: nn.Module) -> nn.Sequential:
    llm = peft.base_model.model
    return nn.Sequential(Embed(llm), *(Block(b) for b in llm.model.layers), Head(llm))


class LoraLlama(L.LightningModule):
    def __init__(self, vocab: int, block: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.peft = with_lora(vocab, block, dropout)
        self.layers = pipeline_of(self.peft)

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
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--root", default="runs/peft_lora")
    p.add_argument("--check", action="store_true", help="train 3 steps and compare the adapter with one process's")
    args = p.parse_args(argv)
    steps = 3 if args.check else args.steps
    lightning_avgpipe.share_cpu_threads(2)
    data, vocab = text_batches(32, 16 * steps)
    root = Path(args.root)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_avgpipe.AvgPipeStrategy(num_microbatches=args.microbatches),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    model = LoraLlama(vocab)
    loader = DataLoader(data, batch_size=16)
    trainer.fit(model, loader)
    if not trainer.is_global_zero:  # this rank's module holds its own stage only: save_pretrained would refuse
        return 0
    model.peft.save_pretrained(root / "adapter")  # the whole trained model is back in this process's module
    from safetensors.torch import load_file

    saved = load_file(root / "adapter" / "adapter_model.safetensors")
    print(f"saved {root / 'adapter'}: {len(saved)} LoRA tensors")
    if not args.check:
        return 0
    ref = with_lora(vocab, 32, 0.0)  # one process, accumulation over the same micro-batches
    layers = pipeline_of(ref)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3)
    for ids, targets in loader:
        opt.zero_grad()
        for mi, mt in zip(ids.tensor_split(args.microbatches), targets.tensor_split(args.microbatches)):
            loss = F.cross_entropy(layers(mi).flatten(0, 1), mt.flatten()) * (len(mi) / len(ids))
            loss.backward()
        opt.step()
    ref.save_pretrained(root / "adapter-one-process")
    want = load_file(root / "adapter-one-process" / "adapter_model.safetensors")
    worst = max((saved[k] - v).abs().max().item() for k, v in want.items()) if saved.keys() == want.keys() else None
    print(f"one process: {len(want)} LoRA tensors; max |pipelined - one process| = {worst}")
    ok = worst is not None and worst < 5e-5
    print("check: OK" if ok else "check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
