"""The online search for the advance-forward count k, with made-up step times and memory."""

from __future__ import annotations

import pytest

from lightning_avgpipe.algorithms.advance_k import AdvanceSearch, added_bytes


def _run(search: AdvanceSearch, time_of_k, peak: float = 0.0, unit: float = 0.0) -> list[int]:
    """Feed the search until it settles; ``time_of_k`` maps k to a step time, or to a list cycled per iteration."""
    ks = []
    seen: dict[int, int] = {}
    for _ in range(200):
        k = search.k
        ks.append(k)
        t = time_of_k[k]
        if isinstance(t, list):
            t = t[seen.get(k, 0) % len(t)]
        seen[k] = seen.get(k, 0) + 1
        search.observe(t, [peak + k * unit], [unit])
        if search.settled:
            break
    return ks


def test_passes_a_flat_step_and_finds_the_faster_k() -> None:
    # a curve with flat steps: k = 2j + 1 as fast as k = 2j (an early forward that lands where no stage waited)
    curve = {0: 1.35, 1: 1.35, 2: 1.19, 3: 1.19, 4: 1.03, 5: 1.03, 6: 0.87, 7: 0.87}
    search = AdvanceSearch(max_k=7)
    ks = _run(search, curve)
    assert search.settled and search.k == 6, search.reason
    assert sorted(set(ks)) == list(range(8))  # it passed every flat step up to AFAB's k
    assert ks[:4] == [0, 0, 0, 0]  # 1 warm-up + 3 measured per k
    assert "settled on advance_forwards=6 (870.0 ms per iteration, the fastest measured)" in search.reason
    assert "largest useful value" in search.reason and "k0:1350.0" in search.reason


def test_greedy_patience_one_stops_on_the_first_flat_step() -> None:
    curve = {0: 1.35, 1: 1.35, 2: 1.19, 3: 1.19}
    search = AdvanceSearch(max_k=3, patience=1)
    ks = _run(search, curve)
    assert search.k == 0 and 2 not in ks
    assert "k=1 not faster than 1350.0 ms at k=0 by more than 3% (1 in a row, patience 1)" in search.reason


def test_flat_then_better_then_flat_stops_after_patience() -> None:
    search = AdvanceSearch(max_k=7)
    ks = _run(search, {0: 1.0, 1: 1.0, 2: 0.8, 3: 0.8, 4: 0.8, 5: 0.5})
    assert search.k == 2, search.reason
    assert max(ks) == 4  # k = 3 and 4 did not improve on k = 2: patience 2 spent, k = 5 never tried
    assert "k=3..4 not faster than 800.0 ms at k=2 by more than 3% (2 in a row, patience 2)" in search.reason


def test_monotone_improvement_climbs_to_max_k() -> None:
    search = AdvanceSearch(max_k=5)
    ks = _run(search, {k: 1.0 - 0.1 * k for k in range(6)})
    assert search.k == 5 and max(ks) == 5
    assert "k=5 is the largest useful value (no larger k changes the plan)" in search.reason


def test_slow_gradual_gains_are_compared_with_the_last_improvement() -> None:
    # 2% per k: no single step beats its predecessor by 3%, but every second one beats the last improvement
    curve = {k: 1.0 * 0.98**k for k in range(8)}
    search = AdvanceSearch(max_k=7)
    _run(search, curve)
    fastest = curve[7]
    assert search.k == min(k for k, t in curve.items() if t <= fastest * 1.03) == 6


def test_noisy_plateau_settles_on_the_smallest_k_within_noise_of_the_best() -> None:
    # jittery iterations around an unchanged step time: medians 1.00, 0.99, 0.98, none better by 3%
    curve = {0: [1.05, 1.00, 0.97], 1: [0.99, 1.20, 0.95], 2: [0.90, 0.98, 1.01]}
    search = AdvanceSearch(max_k=7)
    ks = _run(search, curve)
    assert search.k == 0 and max(ks) == 2, search.reason
    assert "within 3% of the fastest, k=2 at 980.0 ms" in search.reason


def test_plateau_after_a_gain_keeps_the_first_k_of_the_plateau() -> None:
    search = AdvanceSearch(max_k=7)
    _run(search, {0: 1.0, 1: 0.9, 2: 0.885, 3: 0.88})
    assert search.k == 1, search.reason  # 0.90 is within 3% of 0.88: k = 2, 3 cost memory for nothing


def test_worse_after_the_best_returns_to_the_best() -> None:
    search = AdvanceSearch(max_k=7)
    ks = _run(search, {0: 1.0, 1: 0.8, 2: 0.7, 3: 0.9, 4: 1.1})
    assert max(ks) == 4 and search.k == 2, search.reason
    assert ks[-1] == 4  # the last observation was at k = 4; the next iteration runs k = 2
    assert "settled on advance_forwards=2 (700.0 ms per iteration, the fastest measured)" in search.reason


def test_one_slow_median_in_a_descent_does_not_end_it() -> None:
    search = AdvanceSearch(max_k=4)
    _run(search, {0: 1.0, 1: 1.08, 2: 0.8, 3: 0.8, 4: 0.6})
    assert search.k == 4, search.reason


def test_memory_limit_keeps_k_below_what_does_not_fit() -> None:
    search = AdvanceSearch(max_k=7, memory_limit=2.5 * 2**20)
    ks = _run(search, {k: 1.0 - 0.1 * k for k in range(8)}, peak=1 * 2**20, unit=0.5 * 2**20)
    # peak at k is 1 + 0.5 k MiB: k = 3 uses 2.5 MiB (fits), k = 4 would need 3 MiB
    assert search.k == 3 and max(ks) == 3
    assert "k=4 would need about 3.0 MiB on a stage, over the limit of 2.5 MiB" in search.reason


def test_memory_limit_during_a_flat_step_settles_on_the_best_measured() -> None:
    # k = 2 is a flat step (no faster than k = 1) and k = 3 would not fit: back to k = 1, the cheaper of the two
    search = AdvanceSearch(max_k=7, memory_limit=2.0 * 2**20)
    ks = _run(search, {0: 1.0, 1: 0.8, 2: 0.8, 3: 0.6}, peak=1 * 2**20, unit=0.5 * 2**20)
    assert search.k == 1 and max(ks) == 2, search.reason
    assert "stopped at k=2: k=3 would need about 2.5 MiB on a stage, over the limit of 2.0 MiB" in search.reason


def test_no_room_for_one_more_unit_stays_at_zero() -> None:
    search = AdvanceSearch(max_k=7, memory_limit=1.2 * 2**20)
    ks = _run(search, {0: 1.0, 1: 0.5}, peak=1 * 2**20, unit=0.5 * 2**20)
    assert search.k == 0 and set(ks) == {0}


def test_max_k_zero_settles_at_once() -> None:
    search = AdvanceSearch(max_k=0)
    ks = _run(search, {0: 1.0})
    assert search.k == 0 and len(ks) == 4 and "largest useful value" in search.reason


def test_settled_search_ignores_further_observations() -> None:
    search = AdvanceSearch(max_k=1)
    _run(search, {0: 1.0, 1: 0.5})
    assert search.settled and search.k == 1
    assert search.observe(9.0, [0.0], [0.0]) == 1 and search.k == 1


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="patience"):
        AdvanceSearch(max_k=3, patience=0)


def test_added_bytes_grows_every_stage_but_the_last() -> None:
    # S = 4, U = 6: stash [4, 3, 2, 1] at k = 0, [5, 4, 3, 1] at k = 1; the last stage keeps 1F1B's one unit
    assert added_bytes([8.0, 6.0, 4.0, 9.0], 4, 6, 0) == [2.0, 2.0, 2.0, 0.0]
    # k = 2: stash [6, 5, 4, 1]; stage 0 holds all 6 units, so k = 3 adds nothing there either
    assert added_bytes([12.0, 10.0, 8.0, 9.0], 4, 6, 2) == [0.0, 2.0, 2.0, 0.0]
    assert added_bytes([5.0], 1, 8, 3) == [0.0]  # one stage is the last: advance is 1F1B
    with pytest.raises(ValueError, match="2 entries for 3 stages"):
        added_bytes([1.0, 2.0], 3, 6, 0)


def test_a_heavy_last_stage_does_not_stop_the_search() -> None:
    # the last stage is nearest the limit, but k + 1 adds nothing there: the search climbs until stage 0 would not fit
    MiB = 2**20
    search = AdvanceSearch(max_k=6, memory_limit=10 * MiB)
    S, U = 2, 8
    for _ in range(200):
        k = search.k
        peaks = [(min(U, S + k)) * 1.0 * MiB, 9.5 * MiB]  # stage 0: 1 MiB a unit; the last stage: 9.5 MiB at any k
        search.observe(1.0 - 0.05 * k, peaks, added_bytes(peaks, S, U, k))
        if search.settled:
            break
    assert search.k == 6 and "largest useful value" in search.reason, search.reason
