"""The character GPT's command-line flags, defined once for ``examples/char_gpt.py`` and the benchmarks.

Plain argparse, no torch: a benchmark's launcher process imports it without paying for torch or Lightning.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

# GPTConfig's size fields, each a flag (--n-layer, ...), with its --help text
SIZES = {
    "n_layer": "transformer blocks",
    "n_embd": "embedding width",
    "n_head": "attention heads",
    "block_size": "context length in characters",
}


def add_model_args(parser: argparse.ArgumentParser, *, n_layer: int, n_embd: int, n_head: int, block_size: int) -> None:
    """Add ``--n-layer``, ``--n-embd``, ``--n-head`` and ``--block-size``, with the caller's defaults."""
    defaults = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "block_size": block_size}
    for name, text in SIZES.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name], help=text)


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop through ``parser.error`` when the sizes cannot build the model."""
    if min(model_sizes(args).values()) < 1:
        parser.error("--n-layer, --n-embd, --n-head and --block-size must be >= 1")
    if args.n_embd % args.n_head:
        parser.error("--n-embd must be a multiple of --n-head")


def model_sizes(obj: Any) -> dict[str, int]:
    """The sizes in ``obj`` (parsed flags, a ``GPTConfig`` or a dict), as keyword arguments of ``GPTConfig``."""
    if isinstance(obj, Mapping):
        return {name: obj[name] for name in SIZES}
    return {name: getattr(obj, name) for name in SIZES}


def add_partition_arg(parser: argparse.ArgumentParser) -> None:
    """Add the benchmarks' ``--partition``: the layers of each of two stages."""
    parser.add_argument(
        "--partition",
        default=None,
        help="layers per stage, e.g. '3,3' (Embed + blocks + Head = n_layer + 2 layers); default: "
        "Embed and the first half of the blocks on stage 0, the rest and the Head on stage 1",
    )


def partition_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """``--partition`` as the layer counts of the two stages, checked against the model's ``n_layer + 2`` layers."""
    n_layers = args.n_layer + 2
    if args.partition is None:
        first = 1 + args.n_layer // 2
        counts = [first, n_layers - first]
    else:
        try:
            counts = [int(v) for v in str(args.partition).split(",")]
        except ValueError:
            parser.error(f"--partition must be comma-separated ints, got {args.partition!r}")
    if len(counts) != 2 or sum(counts) != n_layers or min(counts) < 1:
        parser.error(f"--partition must be 2 positive counts summing to n_layer + 2 = {n_layers}, got {counts}")
    return counts
