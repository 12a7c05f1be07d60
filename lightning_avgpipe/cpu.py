"""CPU threads for several stage processes on one machine."""

from __future__ import annotations

import os

import torch

from lightning_avgpipe.checks import is_int


def share_cpu_threads(processes: int) -> int:
    """Give each of ``processes`` processes on this machine its share of the cores; call it first thing.

    With S stages on one machine's CPUs, every process otherwise starts torch's thread pool with all the cores.
    Lightning lowers each process to its share when it launches them, but by then a model built in the script has
    already started the pool, whose idle threads (presumably spin-waiting) slow the other stages (measured on 2
    cores, 2 stages, the char GPT with M = 1, N = 4: 458-478 ms per iteration left to Lightning, 345 ms with this
    call first). Does nothing when ``OMP_NUM_THREADS`` is set (you chose). Sets it otherwise, so the processes
    Lightning starts inherit it. Returns the number of threads in use.
    """
    if not is_int(processes, 1):
        raise ValueError(f"processes={processes!r} must be an int >= 1: the stage processes sharing this machine.")
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    threads = max(1, (os.cpu_count() or 1) // processes)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return threads


def host_memory_bytes() -> int:
    """This machine's memory for the processes on it: physical RAM, or the container's limit when lower.

    Reads the cgroup limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); "max" or an absurdly large v1 value
    means no limit.
    """
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total
