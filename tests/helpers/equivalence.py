"""The Lightning equivalence runs the tests share: a job of ``tests/helpers/lightning_worker.py`` on ``devices``
processes (:func:`run_lightning`), its final checkpoint's weights, and the check against plain training with
accumulation (:func:`assert_matches`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.helpers.launch import launch_ranks
from tests.helpers.lit import reference

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # gloo's collective workers and its transport loop


def run_lightning(
    tmp_path: Path, devices: int, strategy: dict[str, Any] | str, steps: int = 4, **extra: Any
) -> list[dict[str, Any]]:
    cfg = {"out": str(tmp_path), "devices": devices, "steps": steps, "strategy": strategy, **extra}
    results = launch_ranks(
        ["-m", "tests.helpers.lightning_worker", json.dumps(cfg)], devices, timeout=300, preload=True
    )
    failed = [f"rank {r} exited {code}:\n{out[-3000:]}" for r, (code, out) in enumerate(results) if code != 0]
    assert not failed, "\n".join(failed)
    for r in range(devices):  # a gloo thread alive when the interpreter finalizes can abort it (tests/test_exit.py)
        threads = json.loads((tmp_path / f"rank{r}.exit.json").read_text())["threads"]
        assert not [t for t in threads if t in GLOO_THREADS], f"rank {r}: gloo threads alive at finalization: {threads}"
    return [dict(json.loads((tmp_path / f"rank{r}.json").read_text()), output=results[r][1]) for r in range(devices)]


def final_state(tmp_path: Path) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / "final.ckpt", weights_only=False)["state_dict"]


def assert_matches(tmp_path: Path, results: list[dict[str, Any]], m: int, steps: int = 4, **ref: Any) -> None:
    ref_losses, ref_state = reference(steps, m, **ref)
    for r in results:  # every rank reports the same, broadcast loss
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses))
        assert r["threads"] == [], r["threads"]  # after fit no thread of ours (the watchdog) is left running
    state = final_state(tmp_path)
    layer_keys = [k for k in state if k.startswith("layers.")]
    assert sorted(layer_keys) == sorted(ref_state)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], msg=lambda msg, key=key: f"{key}: {msg}")
