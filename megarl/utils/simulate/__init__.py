"""A discrete-event model of the synchronous and the asynchronous RL schedule (`megarl simulate`).

    model.py      the inputs: cluster layout, response lengths, decode speed, trainer costs, async knobs
    engine.py     a continuously batched rollout engine and the least-outstanding router
    schedules.py  simulate_sync / simulate_async -> Result (samples/s, idle shares, staleness trace)
    calibrate.py  fit the model's constants to a run's metrics.jsonl (+ its config.yaml)
    presets.py    named cluster scenarios (7B on 64 GPUs, ...) and the assumptions behind them

Pure Python: imports neither torch, numpy, Ray, megatron nor vLLM, and nothing from megarl outside this package.
"""

from megarl.utils.simulate.model import Async, Costs, Decode, Layout, Lengths, SimConfig
from megarl.utils.simulate.schedules import Result, simulate_async, simulate_sync

__all__ = ["Async", "Costs", "Decode", "Layout", "Lengths", "Result", "SimConfig", "simulate_async", "simulate_sync"]
