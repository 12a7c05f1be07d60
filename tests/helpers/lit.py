"""A pipeline-ready LightningModule for tests, and the plain-PyTorch references it must match (float32, float16 with
a GradScaler, N elastic replicas)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_avgpipe.algorithms import microbatch
from tests.helpers.models import Sleep, make_layers


def quiet_trainer(root: Any, **kwargs: Any) -> L.Trainer:
    """A one-process CPU Trainer without logger, progress bar, model summary or sanity check; ``kwargs`` add to or
    replace those."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
    )
    return L.Trainer(**{**defaults, **kwargs})


def dataset(n: int = 48, inputs: int = 8, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, inputs, generator=g), torch.randint(0, classes, (n,), generator=g))


def loader(batch_size: int = 12, n: int = 48) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch_size, shuffle=False)


class PipeNet(L.LightningModule):
    def __init__(
        self,
        lr: float = 0.1,
        optimizer: str = "sgd",
        scheduler: bool = False,
        epoch_metric: bool = False,
        noisy: bool = False,
        sleep: list[float] | None = None,
        stepping: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers = make_layers()
        if noisy:  # RNG (dropout) and buffers (BatchNorm statistics) that profiling must leave as they were
            layers[4] = nn.Sequential(nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3))
        if sleep is not None:  # known costs: [fixed forward, forward per row, fixed backward, backward per row]
            layers = [layers[0], Sleep(*sleep), layers[3], Sleep(*sleep), layers[4], layers[5]]
        self.layers = nn.Sequential(*layers)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_correct", (logits.argmax(-1) == y).sum().float(), reduce_fx="sum", on_epoch=True)
        if self.hparams.epoch_metric:  # updated here, computed and logged at epoch end
            self.val_acc.update(logits, y)
        else:
            self.val_acc(logits, y)
            self.log("val_acc", self.val_acc)

    def on_validation_epoch_end(self) -> None:
        if self.hparams.epoch_metric:
            self.log("val_acc", self.val_acc.compute())
            self.val_acc.reset()

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x)

    def configure_optimizers(self) -> Any:
        if self.hparams.stepping:  # as OneCycleLR(total_steps=...) users do: sets the training loader up early
            assert self.trainer.estimated_stepping_batches > 0
        return build_optimizer(self.parameters(), self.hparams.lr, self.hparams.optimizer, self.hparams.scheduler)


class LateNet(PipeNet):
    """PipeNet whose layers are built in ``configure_model`` (under AvgPipe: on the meta device, each rank making
    only its own stages real), with the same values."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        del self.layers

    def configure_model(self) -> None:
        if not hasattr(self, "layers"):
            self.layers = nn.Sequential(*make_layers())


class _Wrap(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class AliasedNet(PipeNet):
    """PipeNet that keeps its whole model (``self.layers``, as a user keeps a library model to call its ``generate()``)
    beside wrappers around those layers, which ``configure_pipeline()`` returns: every layer has two names,
    ``layers.i`` first (registered first) and ``wrapped.i.inner``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wrapped = nn.Sequential(*(_Wrap(layer) for layer in self.layers))

    def configure_pipeline(self) -> nn.Sequential:
        return self.wrapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrapped(x)


def build_optimizer(params: Any, lr: float, name: str, scheduler: bool) -> Any:
    params = list(params)
    opt = {
        "sgd": lambda: torch.optim.SGD(params, lr=lr, momentum=0.9),
        "adam": lambda: torch.optim.Adam(params, lr=lr),
        "adamw": lambda: torch.optim.AdamW(params, lr=lr),
    }[name]()
    if not scheduler:
        return opt
    return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def reference(
    steps: int,
    m: int,
    lr: float = 0.1,
    optimizer: str = "sgd",
    scheduler: bool = False,
    clip: float | None = None,
    accumulate: int = 1,
    batch_size: int = 12,
    bf16: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain training of PipeNet's layers with gradient accumulation over the same micro-batches."""
    layers = nn.Sequential(*make_layers())
    built = build_optimizer(layers.parameters(), lr, optimizer, scheduler)
    opt = built["optimizer"] if isinstance(built, dict) else built
    sched = built["lr_scheduler"] if isinstance(built, dict) else None
    data = dataset()
    batches = []
    for epoch in range(steps * accumulate * batch_size // len(data) + 1):
        batches += epoch_batches(epoch, batch_size, data)
    per_epoch = -(-len(data) // batch_size)
    losses: list[float] = []
    step = 0
    i = 0
    opt.zero_grad()
    while step < steps:
        x, y = batches[i % len(batches)]
        total = 0.0
        for mx, my in zip(microbatch.split(x, m), microbatch.split(y, m)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as Lightning: forward and loss only
                loss = F.cross_entropy(layers(mx), my) * (len(mx) / len(x))
            (loss / accumulate).backward()
            total += loss.item()
        losses.append(total)
        i += 1
        if i % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(layers.parameters(), clip)
            opt.step()
            opt.zero_grad()
            step += 1
            if sched is not None and i % per_epoch == 0:
                sched.step()
    return losses, {f"layers.{k}": v for k, v in layers.state_dict().items()}


def evaluate(state: dict[str, torch.Tensor], batch_size: int = 12) -> tuple[float, float, torch.Tensor]:
    """Validation loss, accuracy and logits of the plain model with ``state`` on the (unshuffled) loader."""
    layers = nn.Sequential(*make_layers())
    layers.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
    with torch.no_grad():
        logits = torch.cat([layers(x) for x, _ in loader(batch_size)])
    y = dataset().tensors[1]
    return F.cross_entropy(logits, y).item(), (logits.argmax(-1) == y).float().mean().item(), logits


def epoch_batches(
    epoch: int, batch_size: int = 12, data: TensorDataset | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of training batches (of ``data``, default :func:`dataset`) in the order one pipeline group (D = 1)
    reads them: the loader's own, here ``shuffle=False`` (the strategy puts no DistributedSampler on it), the same
    every epoch."""
    data = data if data is not None else dataset()
    order = list(range(len(data)))
    return [
        (data.tensors[0][order[i : i + batch_size]], data.tensors[1][order[i : i + batch_size]])
        for i in range(0, len(order), batch_size)
    ]


def fp16_reference(steps: int, m: int, overflow_at: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """PipeNet's layers in one process: float16 autocast around forward and loss, the loss scaled per micro-batch,
    SGD through ``torch.amp.GradScaler("cpu")``; ``overflow_at``: that step's first weight gets an inf gradient."""
    layers = nn.Sequential(*make_layers())
    opt = torch.optim.SGD(layers.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    batches = epoch_batches(0) + epoch_batches(1)
    scales = []
    for step in range(steps):
        x, y = batches[step]
        handle = layers[0].weight.register_hook(lambda g: g * float("inf")) if step == overflow_at else None
        for mx, my in zip(microbatch.split(x, m), microbatch.split(y, m)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(layers(mx), my) * (len(mx) / len(x))
            scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))
    return scales, {f"layers.{k}": v for k, v in layers.state_dict().items()}


def reference_elastic(
    steps: int,
    m: int,
    pipelines: int,
    lr: float = 0.1,
    optimizer: str = "sgd",
    batch_size: int = 12,
    **averaging: Any,
) -> tuple[list[float], dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """AvgPipe on one process: N replicas, each on its own consecutive batch, their own optimizer, then the rule
    (``averaging``: ``ElasticAveraging``'s ``outer_lr``, ``outer_momentum``, ``period``).

    Returns the per-iteration loss (mean over replicas), the reference's state and every replica's state.
    """
    layers = list(make_layers())
    losses, elastic = train_elastic(
        layers,
        lambda ps: build_optimizer(ps, lr, optimizer, False),
        dataset(),
        F.cross_entropy,
        steps,
        m,
        pipelines,
        batch_size,
        **averaging,
    )
    ref = {f"layers.{k}": v for k, v in nn.Sequential(*layers).state_dict().items()}
    reps = [{f"layers.{k}": v for k, v in nn.Sequential(*r).state_dict().items()} for r in elastic.replicas]
    return losses, ref, reps


def train_elastic(
    layers: list[nn.Module],
    make_optimizer: Any,
    data: TensorDataset,
    loss_fn: Any,
    steps: int,
    m: int,
    pipelines: int,
    batch_size: int = 12,
    **averaging: Any,
) -> tuple[list[float], Any]:
    """AvgPipe on one process, as Lightning feeds the strategy: the loader's order (D = 1), replica n of N
    taking batch t*N + n, each replica's loss the mean over its micro-batches, its own optimizer, then the elastic
    rule (N = 1: plain training). Returns the per-iteration loss (mean over replicas) and the ``ElasticAveraging``."""
    from lightning_avgpipe.algorithms.elastic import ElasticAveraging

    elastic = ElasticAveraging(layers, num_replicas=pipelines, **averaging)
    opts = [make_optimizer(elastic.replica_params(n)) for n in range(pipelines)]
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        batches = epoch_batches(epoch, batch_size, data)
        for t in range(len(batches) // pipelines):
            if len(losses) == steps:
                break
            total = 0.0
            for n in range(pipelines):
                x, y = batches[t * pipelines + n]
                opts[n].zero_grad()
                net = nn.Sequential(*elastic.replicas[n])
                for mx, my in zip(microbatch.split(x, m), microbatch.split(y, m)):
                    loss = loss_fn(net(mx), my) * (len(mx) / len(x))
                    loss.backward()
                    total += loss.item() / pipelines
            elastic.begin_step()
            for opt in opts:
                opt.step()
            elastic.finish_step()
            losses.append(total)
        epoch += 1
    return losses, elastic
