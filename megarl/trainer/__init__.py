"""The trainer: the Ray driver's RL loop and the worker roles it drives.

    loop.py      RLTrainer: fit() and the step, one phase per line (generate → reward → old log-probs
                 → ref log-probs → values → advantages → critic update → actor update → weight sync)
    run.py       train(cfg, derived): data checks before Ray, workers, the loop; RunData
    cluster.py   Cluster: worker groups per pool, roles composed per process, calls → batches
    engines.py   the rollout engines seen from the driver: colocated, or servers on their own pool
    worker.py    what runs in each worker process: ProcessSetup, Actor/Reference/Critic/RewardModel
                 workers (own engines, own process groups)
    rollout_roles.py  the rollout side of a worker: colocated engine + sharding manager, or the
                 sender that broadcasts the actor's weights to engine servers
    batching.py  prompts + completions → the training batch; responses → text; outcome rewards
    metrics.py   phase timers, step metrics, console/progress bar, JSONL, TensorBoard, plots
    state.py     checkpoint directories, driver state, latest complete checkpoint, pruning

Entry point: `megarl train --config configs/grpo_quickstart.yaml [dotted.overrides=...]`.
Importing this package imports neither Ray, megatron nor vLLM (cluster.py imports Ray).
"""
from megarl.trainer.run import RunData, load_run_data, train

__all__ = ["RunData", "load_run_data", "train"]
