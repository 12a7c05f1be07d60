"""Two nodes of two devices, emulated on one machine: two torchrun agents with ``--nnodes 2`` on loopback, and
SLURM's variables set by hand as Lightning's own tests do. The D x S x T = 1 x 2 x 2 mesh puts each tensor group
inside a node and the stages across the nodes, and training equals plain Lightning on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.checkpoints import PLAIN_ORDER, STEPS, TP, TP_PLAN, assert_states_close, fit_with_checkpoints
from tests.helpers.harness import ROOT, free_port, launch_ranks

STRATEGY = {**TP, "tensor_parallel_plan": TP_PLAN}
MODEL = {"optimizer": "adam", "lr": 0.01}


def _cfg(out: Path) -> dict[str, Any]:
    return {
        "out": str(out),
        "devices": 2,  # per node
        "steps": STEPS,
        "strategy": STRATEGY,
        "model": MODEL,
        "trainer": {**PLAIN_ORDER, "num_nodes": 2},
    }


def _check(out: Path, plain: dict[str, torch.Tensor], environment: str) -> None:
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["environment"] for r in results} == {environment}  # the launcher Lightning recognised
    for r, result in enumerate(results):
        node, group, stage, shard, tensor_ranks = result["place"]
        assert (node, group, stage, shard) == (r // 2, 0, r // 2, r % 2), result["place"]
        assert [t // 2 for t in tensor_ranks] == [node, node]  # the tensor group: this node's two ranks
    state = torch.load(out / "final.ckpt", weights_only=True)["state_dict"]
    assert_states_close({k: v for k, v in state.items() if k.startswith("layers.")}, plain)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    _, model = fit_with_checkpoints(tmp_path_factory.mktemp("plain"), STEPS)
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_torchrun_agents_with_two_nodes(tmp_path: Path, plain: dict[str, torch.Tensor]) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    cfg = json.dumps(_cfg(tmp_path))
    agents = [
        subprocess.Popen(
            [
                str(torchrun),
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=2",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "-m",
                "tests.helpers.lightning_worker",
                cfg,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in range(2)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=240)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    _check(tmp_path, plain, "TorchElasticEnvironment")


def _slurm(rank: int) -> dict[str, str]:
    return {
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % 2),
        "SLURM_NODEID": str(rank // 2),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "avgpipe",
        "SLURM_NODELIST": "127.0.0.1",
        "LOCAL_RANK": str(rank % 2),
        "NODE_RANK": str(rank // 2),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slurm_variables_for_two_nodes(tmp_path: Path, plain: dict[str, torch.Tensor]) -> None:
    args = ["-m", "tests.helpers.lightning_worker", json.dumps(_cfg(tmp_path))]
    results = launch_ranks(args, 4, timeout=240, env=_slurm, preload=True)  # ranks forked with Lightning imported
    failed = [f"rank {r} exited {code}:\n{out[-3000:]}" for r, (code, out) in enumerate(results) if code != 0]
    assert not failed, "\n".join(failed)
    _check(tmp_path, plain, "SLURMEnvironment")
