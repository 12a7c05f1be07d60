"""Text that ships with every Python install: the standard library's docstrings, as a character data set."""

from __future__ import annotations

import importlib
import inspect

import torch
from torch.utils.data import Dataset

# A fixed list, so the corpus is the same on every machine with the same Python version.
MODULES = (
    "abc argparse ast asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime decimal "
    "difflib email enum fractions functools gettext glob gzip hashlib heapq hmac html http inspect io ipaddress "
    "itertools json logging lzma math mimetypes numbers operator optparse os pathlib pickle pprint queue random re "
    "sched secrets shelve shlex shutil smtplib socket sqlite3 statistics string struct subprocess tarfile tempfile "
    "textwrap threading timeit tokenize traceback typing unittest urllib uuid warnings weakref xml zipfile zlib"
).split()


def stdlib_docstrings(max_chars: int = 2_000_000) -> str:
    """Concatenate the docstrings of the modules above and their public members, ASCII only."""
    parts: list[str] = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a missing optional module just shrinks the corpus
            continue
        for obj in [mod, *(getattr(mod, a, None) for a in sorted(dir(mod)) if not a.startswith("_"))]:
            doc = inspect.getdoc(obj) if obj is not None else None
            if doc and len(doc) > 40:
                parts.append(doc)
    text = "\n\n".join(dict.fromkeys(parts))  # drop repeats (inherited docstrings), keep order
    return text.encode("ascii", "ignore").decode()[:max_chars]


class CharDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` characters: input ``x[:-1]``, target ``x[1:]``."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


def encode(text: str) -> tuple[torch.Tensor, list[str]]:
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), chars
