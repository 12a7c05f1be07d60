"""ProcessStrategy: the one-process-per-device plumbing every Lightning parallel strategy repeats (ranks, the
launcher, the process group, plain collectives), kept apart from what is AvgPipe's (``strategy.py``).

It follows Lightning 2.6's ``DDPStrategy`` and ``ModelParallelStrategy`` for these hooks; ``AvgPipeStrategy``
subclasses it and adds only the pipeline's hooks.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from lightning_avgpipe.plugin.compat import (
    ScriptLaunchedStrategy,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
    attached_trainer,
)
from lightning_avgpipe.plugin.process.launcher import note_failure, short_errors, watch_launcher
from lightning_avgpipe.plugin.split.hints import note_setup_order
from lightning_avgpipe.runtime.failures import console
from lightning_avgpipe.runtime.failures.report import guarded, handle_failure
from lightning_avgpipe.runtime.failures.shutdown import close_at_exit, mark_failed
from lightning_avgpipe.runtime.failures.watchdog import Watchdog


class ProcessStrategy(ScriptLaunchedStrategy):
    """One process per device, joined by a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA).

    Args:
        process_group_backend: ``"gloo"`` or ``"nccl"``; ``None`` picks by device.
        timeout: seconds a collective may block before it fails.
        accelerator: Lightning's own, as for any strategy (the Trainer sets it, as the next four).
        parallel_devices: the devices of this node.
        cluster_environment: where the ranks come from (Lightning's, torchrun, SLURM).
        checkpoint_io: how checkpoints are written and read.
        precision_plugin: the precision the Trainer was given.
    """

    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: float = 1800.0,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._process_group_backend = process_group_backend
        self._process_group_timeout = timeout
        self._num_nodes = 1
        self._watchdog: Watchdog | None = None

    def init_processes(self) -> None:
        """Ranks, seeds and the default process group (what ``setup_environment`` does for every such strategy)."""
        reset_seed()
        watch_launcher()  # a rank the default launcher started ends itself once the launching process is gone
        short_errors()  # a mistake this package names: a few lines on the console, the traceback in a file
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=timedelta(seconds=self._process_group_timeout))
        close_at_exit(self)  # a gloo group still alive when the interpreter finalizes can abort it (SIGABRT)
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:  # the short errors' tracebacks: in the log directory (a collective, rank 0's)
            console.set_folder(trainer.log_dir or trainer.default_root_dir)

    def close(self) -> None:
        """Called once at interpreter exit, before the process groups are destroyed: drop every reference to a
        group, so destroying them frees them and joins their threads (``runtime/failures/shutdown.py``)."""
        self.stop_watchdog()

    # -- failures ------------------------------------------------------------------------------------------------
    def start_watchdog(self, name: str, grace: float) -> None:
        """With more than one process: a thread that ends this one ``grace`` s after any rank recorded a failure
        while this one is still running (``runtime/failures/watchdog.py``)."""
        if self.world_size > 1 and self._watchdog is None:
            self._watchdog = Watchdog(name, grace=grace).start()

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def failure_site(self) -> str:
        """This rank, as the failure messages name it (``"rank 1 (stage 1)"``)."""
        return f"rank {self.global_rank}"

    @override
    def on_exception(self, exception: BaseException) -> None:
        note_setup_order(exception, self.lightning_module)  # setup() reading what configure_model() builds
        if _distributed_is_initialized():  # recorded for every rank to name; see docs/how-it-works.md#failure-handling
            handle_failure(exception, self.failure_site(), self.global_rank, self.world_size)
        mark_failed()  # at exit, leave the groups be: destroying one could wait on a rank that is gone
        note_failure(exception)  # the launching process ends the ranks it started, at exit

    @override
    def teardown(self) -> None:
        self.stop_watchdog()
        module = self.lightning_module
        if module is None or not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            super().teardown()
            return
        # A build that failed left tensors on the meta device: Lightning's module.cpu() would raise "Cannot copy out
        # of meta tensor" over the error that ended the run. The module stays where it is.
        module.cpu = lambda: module  # type: ignore[method-assign]
        try:
            super().teardown()
        finally:
            del module.cpu

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's accelerator connector (hasattr) when it prepares a loader: True makes it put a
        # DistributedSampler on it, which shards (and, for training, shuffles) the data as DDP does. That is right
        # across D > 1 pipeline groups; with one group every rank must read the user's loader as it is (a
        # shuffle=False loader stays in order, as on one device). sync_dist logging reduces over the D ranks of a
        # stage, nothing to do for D = 1.
        return self.data_parallel_size() > 1

    def data_parallel_size(self) -> int:
        """D, the groups that read different data (before the processes are up: more than one, the safe guess)."""
        return 2

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        with guarded(f"the barrier {name!r}" if name else "a barrier"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with guarded(f"a broadcast from rank {src}", record=False):  # Lightning's Timer broadcasts every step
            dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = _sync_ddp_if_available(flag, None, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)
