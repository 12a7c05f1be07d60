"""Made-up tuning profiles for the cost model's and the search's tests: stages whose costs are linear in the
micro-batch size, and a pipeline of equal ones."""

from __future__ import annotations

from lightning_avgpipe.tuning import PipelineProfile, StageProfile


def stage(
    f: float = 1e-3,
    act: float = 1e6,
    send: float = 1e5,
    params: float = 4e6,
    opt_s: float = 2e-4,
    elastic_s: float = 1e-4,
    fixed: float = 0.0,
) -> StageProfile:
    """Costs linear in the micro-batch size b (plus ``fixed`` per unit), measured at b = 1, 2 and 8."""
    sizes = (1.0, 2.0, 8.0)
    return StageProfile(
        forward_s={b: fixed + f * b for b in sizes},
        backward_s={b: fixed + 2 * f * b for b in sizes},
        activation_bytes={b: act * b for b in sizes},
        send_bytes={b: send * b for b in sizes},
        param_bytes=params,
        optimizer_state_bytes=2 * params,
        optimizer_step_s=opt_s,
        elastic_s=elastic_s,
    )


def profile(num_stages: int = 4, **kw: float) -> PipelineProfile:
    link = {
        k: kw.pop(k)
        for k in (
            "latency_s",
            "bandwidth",
            "iteration_overhead_s",
            "unit_overhead_s",
            "batch_fetch_s",
            "sync_reference",
            "accumulate",
        )
        if k in kw
    }
    return PipelineProfile(
        [stage(**kw) for _ in range(num_stages)], batch_size=8, **{"latency_s": 2e-3, "bandwidth": 1e9, **link}
    )
