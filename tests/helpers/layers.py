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
    # the paper's algorithms (algorithms/), its micro-batches and noise maths a layer below its other modules
    "lightning_avgpipe.algorithms.microbatch": 1,
    "lightning_avgpipe.algorithms.noise_scale": 1,
    "lightning_avgpipe.algorithms": 2,
    "lightning_avgpipe.config": 2,
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


# the rooms inside a layer: a subpackage of plugin/ or runtime/, or algorithms/ at the package's root -> what it may
# import of its own package besides itself (a room or a module, by its path under the package;
# docs/how-it-works.md#rooms shows the same map). The modules at a package's root (the strategy, the step core) may
# import any of their package's rooms.
ROOMS: dict[str, tuple[str, ...]] = {
    "plugin/checkpoint": ("plugin/compat.py", "plugin/split", "plugin/process/base.py"),
    "plugin/split": ("plugin/compat.py", "plugin/contract.py", "plugin/checkpoint/resume.py", "plugin/steps/data.py"),
    "plugin/steps": ("plugin/compat.py", "plugin/contract.py", "plugin/split/placeholders.py"),
    "plugin/process": ("plugin/compat.py", "plugin/split/hints.py"),
    "plugin/tuner": ("plugin/compat.py", "plugin/strategy.py", "plugin/checkpoint/resume.py", "plugin/steps"),
    "runtime/failures": (),
    "runtime/build": ("runtime/failures",),
    "runtime/files": ("runtime/failures",),
    "runtime/comms": ("runtime/failures", "runtime/sharding/tensor_parallel.py"),
    "runtime/sharding": ("runtime/comms/p2p.py", "runtime/build/materialize.py", "runtime/deferred.py"),
    "runtime/sync": ("runtime/comms", "runtime/sharding"),
    "algorithms": ("checks.py", "shards.py", "schedules"),  # the paper's algorithms: of the package, only these
}


def room_of(path: str) -> str | None:
    """The room of a file (a path under the package, ``runtime/failures/report.py``), if it is in one."""
    return next((room for room in ROOMS if path.startswith(room + "/")), None)


def allowed_in_room(room: str, target: str) -> bool:
    """Whether a file of ``room`` may import ``target`` (a path under the package: a module's file, or a package's
    folder): anything outside the room's package (the layers rule that), its own room, and what ``ROOMS`` lists."""
    package = room.rpartition("/")[0]  # "" for a room at the package's root: every target is in its package
    if (package and not target.startswith(package + "/")) or target.startswith(room + "/"):
        return True
    return any(target == a or target.startswith(a.removesuffix(".py") + "/") for a in ROOMS[room])
