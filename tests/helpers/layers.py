"""The package's layers, lowest first (``tests/test_import_layers.py`` says what they mean and checks them)."""

from __future__ import annotations

# module (or package) -> layer; the longest matching prefix decides
LAYERS: dict[str, int] = {
    "lightning_avgpipe.__about__": 0,
    "lightning_avgpipe.checks": 0,
    "lightning_avgpipe.errors": 0,
    "lightning_avgpipe.cpu": 0,
    "lightning_avgpipe.shards": 0,
    "lightning_avgpipe.schedules": 1,
    "lightning_avgpipe.microbatch": 1,
    "lightning_avgpipe.noise_scale": 1,
    "lightning_avgpipe.elastic": 2,
    "lightning_avgpipe.optim": 2,
    "lightning_avgpipe.config": 2,
    "lightning_avgpipe.replicas": 2,
    "lightning_avgpipe.advance_k": 2,
    "lightning_avgpipe.runtime": 3,
    "lightning_avgpipe.tuning": 4,
    "lightning_avgpipe.partition": 5,
    "lightning_avgpipe.plugin": 6,
    # the entry points: the command lines, and the package's face, which registers the strategy and re-exports
    # names from every layer (lazily)
    "lightning_avgpipe.cli": 7,
    "lightning_avgpipe.__main__": 7,
    "lightning_avgpipe._register": 7,
    "lightning_avgpipe": 7,
}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None
