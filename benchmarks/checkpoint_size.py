"""Checkpoint sizes on the new-user example (``examples/big_model.py``'s Llama, its weights reachable as ``llm.*``
and as the pipeline's ``layers.*``, its embedding tied to its head): AvgPipe's single file and folder at S = 2
against plain Lightning's file on one device, after the same steps (issue 42, item 8).

    python benchmarks/checkpoint_size.py            # about a minute on 2 CPU cores; needs transformers

Prints each checkpoint's bytes, its ratio to plain Lightning's, and how many tensors each holds (a tensor stored
once under two names counts once). Plain Lightning's ``torch.save`` stores a storage shared by two names once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def worker(cfg: dict[str, Any]) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import lightning.pytorch as pl
    import torch
    from big_model import PretrainedLlama
    from rotary_tuple import text_batches
    from torch.utils.data import DataLoader

    from lightning_avgpipe import AvgPipeStrategy

    torch.set_num_threads(1)
    data, _ = text_batches(32, 16 * cfg["steps"])
    strategy: Any = "auto"
    if cfg["devices"] > 1:
        sdc = cfg["kind"] == "folder"
        strategy = AvgPipeStrategy(num_microbatches=4, partition="parameters", save_distributed_checkpoint=sdc)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy=strategy,
        max_steps=cfg["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=cfg["out"],
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(PretrainedLlama(cfg["pretrained"]), DataLoader(data, batch_size=16))
    trainer.save_checkpoint(Path(cfg["out"]) / f"{cfg['kind']}.ckpt")


def stored_tensors(path: Path) -> int:
    """Tensors stored: the folder's DCP keys, or the file's distinct storages."""
    import zipfile

    from lightning_avgpipe.plugin.checkpoint import dcp_reader

    if path.is_dir():
        return len(dcp_reader.load_metadata(path).state_dict_metadata)
    return sum(1 for n in zipfile.ZipFile(path).namelist() if "/data/" in n)


def wider(path: Path, vocab: int, hidden: int) -> None:
    """The example's Llama (tied embedding, 4 layers) at width ``hidden``: per-tensor framing no longer counts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="20MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, help="a random Llama of this width (4 layers) instead of the example's")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    sys.path.insert(0, str(ROOT / "examples"))
    from big_model import save_random_llama
    from rotary_tuple import text_batches

    from tests.helpers.harness import launch_ranks

    out = Path(tempfile.mkdtemp(prefix="checkpoint-size-"))
    _, vocab = text_batches(32, 16)
    if args.hidden:
        wider(out / "pretrained", vocab, args.hidden)
    else:
        save_random_llama(out / "pretrained", vocab, 32)
    runs = (("plain", 1), ("file", 2), ("folder", 2))
    for kind, devices in runs:
        cfg = {
            "out": str(out),
            "devices": devices,
            "kind": kind,
            "steps": args.steps,
            "pretrained": str(out / "pretrained"),
        }
        results = launch_ranks([str(Path(__file__)), "--worker", json.dumps(cfg)], devices, timeout=900)
        failed = [f"rank {r} exited {code}:\n{text[-2000:]}" for r, (code, text) in enumerate(results) if code != 0]
        if failed:
            raise RuntimeError("\n".join(failed))
    plain = size(out / "plain.ckpt")
    print(f"{'checkpoint':34} {'bytes':>10} {'vs plain':>9} {'tensors stored':>15}")
    for kind, label in (
        ("plain", "plain Lightning, one device, file"),
        ("file", "AvgPipe S = 2, one file"),
        ("folder", "AvgPipe S = 2, folder"),
    ):
        path = out / f"{kind}.ckpt"
        print(f"{label:34} {size(path):>10} {size(path) / plain:>8.3f}x {stored_tensors(path):>15}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
