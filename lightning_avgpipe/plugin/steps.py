"""The strategy's training and evaluation steps: Lightning's step hooks mapped onto the stage pipeline's steps, with
the step's loss and logs shared by every stage (docs/how-it-works.md#a-training-step)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_avgpipe import microbatch
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.plugin.bridge import replay_logs
from lightning_avgpipe.plugin.contract import pipeline_inputs
from lightning_avgpipe.plugin.precision import loss_scale_of

if TYPE_CHECKING:
    from lightning_avgpipe.plugin.strategy import AvgPipeStrategy

# the precision plugin's context around each evaluation hook's forwards
EVAL_CONTEXTS = {
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


def training_step(strategy: AvgPipeStrategy, batch: Any, rest: tuple[Any, ...]) -> Tensor:
    """One training iteration: the pipeline's step over the N batches, the user's ``training_step`` as the loss on
    the last stage; returns the loss every stage reports (the last stage's, shared)."""
    module, pipeline, bridge = strategy._lightning(), strategy.pipeline, strategy.bridge
    trainer = module.trainer
    batches = batch if strategy.num_pipelines > 1 else [batch]
    telemetry = strategy._telemetry
    figures = telemetry.wants_figures(trainer, pipeline)
    samples = sum(microbatch.batch_size(b) for b in batches) * strategy.num_groups
    telemetry.step_started(module, samples, log=figures)
    with strategy._stash.apart(pipeline.params):  # Lightning zeroes gradients between training_step and backward
        result = pipeline.train_step(
            batches,
            lambda output, micro, share: bridge.call_step("training_step", output, micro, share, *rest),
            inputs=lambda micro: pipeline_inputs(module, micro),
            accumulate=trainer.accumulate_grad_batches,
            forward_context=strategy.precision_plugin.train_step_context,
            measure=figures,
            divergence=not pipeline.elastic.trivial and compat.writes_logs(trainer),
            noise=compat.writes_logs(trainer) or compat.every(trainer.global_step, strategy.noise_every),
            param_names=strategy._param_names,
            loss_scale=loss_scale_of(strategy.precision_plugin),
        )
    assert strategy._results is not None
    if result.loss is not None:  # the last stage
        loss, logs = strategy._results.exchange(result.loss.cpu(), bridge.take_logs())
    else:
        loss, logs = strategy._results.exchange(None, None)
    if figures:
        telemetry.step_finished(module, pipeline, result, strategy.optimizers)
    replay_logs(module, logs, strategy.root_device)
    loss = loss.to(strategy.root_device)
    if not pipeline.elastic.trivial:  # the mean over replicas, whatever the user logs
        telemetry.log_loss(module, loss)
    return loss


def eval_step(strategy: AvgPipeStrategy, hook: str, args: tuple[Any, ...], share_output: bool) -> Any:
    """``validation_step``/``test_step``/``predict_step`` through the pipeline's forwards; the last stage's logs
    reach every stage, and with ``share_output`` (predict) its output too."""
    module, pipeline, bridge = strategy._lightning(), strategy.pipeline, strategy.bridge
    strategy._telemetry.pause()
    context = getattr(strategy.precision_plugin, EVAL_CONTEXTS[hook])
    results = pipeline.eval_step(
        args[0],
        lambda output, micro, share: bridge.call_step(hook, output, micro, share, *args[1:]),
        inputs=lambda micro: pipeline_inputs(module, micro),
        forward_context=context,
        key=hook,
    )
    payload = output = None
    if pipeline.is_last:
        output = microbatch.merge([results[u] for u in sorted(results)])
        payload = (microbatch.to_cpu(output) if share_output else None, bridge.take_logs())
    shared, logs = pipeline.share(payload)
    replay_logs(module, logs, strategy.root_device)
    return shared if share_output and output is None else output
