"""The online search for the advance-forward count k, with made-up step times and memory."""

from __future__ import annotations

from lightning_avgpipe.autotune import AdvanceSearch


def _run(search: AdvanceSearch, time_of_k: dict[int, float], peak: float = 0.0, unit: float = 0.0) -> list[int]:
    ks = []
    for _ in range(60):
        k = search.k
        ks.append(k)
        search.observe(time_of_k[k], [peak + k * unit], [unit])
        if search.settled:
            break
    return ks


def test_raises_k_while_faster_then_settles_on_the_best() -> None:
    search = AdvanceSearch(max_k=7)
    ks = _run(search, {0: 1.00, 1: 0.90, 2: 0.85, 3: 0.849, 4: 0.8})
    assert search.settled and search.k == 2
    assert "k=3 took 849.0 ms vs 850.0 ms at k=2: not faster by more than 3%" in search.reason
    assert ks[:4] == [0, 0, 0, 0] and 3 in ks  # 1 warm-up + 3 measured per k; k = 3 was tried


def test_stops_at_the_largest_useful_k() -> None:
    search = AdvanceSearch(max_k=2)
    _run(search, {0: 1.0, 1: 0.8, 2: 0.6})
    assert search.k == 2 and "largest useful value" in search.reason


def test_memory_limit_keeps_k_below_what_does_not_fit() -> None:
    search = AdvanceSearch(max_k=7, memory_limit=2.5 * 2**20)
    _run(search, {k: 1.0 - 0.1 * k for k in range(8)}, peak=1 * 2**20, unit=0.5 * 2**20)
    # peak at k is 1 + 0.5 k MiB: k = 3 uses 2.5 MiB (fits), k = 4 would need 3 MiB
    assert search.k == 3 and "k=4 would need about 3.0 MiB on a stage, over the limit of 2.5 MiB" in search.reason


def test_noisy_equal_times_settle_on_zero() -> None:
    search = AdvanceSearch(max_k=5)
    _run(search, {0: 1.0, 1: 0.99, 2: 0.98})
    assert search.k == 0
