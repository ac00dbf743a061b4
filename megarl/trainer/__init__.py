"""The trainer: the Ray driver's RL loop.

    loop.py      RLTrainer: fit() and the step, one phase per line (generate → score → shape → old
                 log-probs → ref log-probs → values → advantages → critic update → actor update →
                 weight sync), driving the roles through `megarl.controller.Cluster`'s typed handles
    async_loop.py AsyncRLTrainer (trainer.mode=async): a producer thread streams prompt groups through
                 the engine servers under the staleness bound into a buffer; the trainer takes
                 batches from it and trains with RLTrainer.learn; updates pause, not drain, the engines
    run.py       train(cfg, derived): data checks before Ray, workers, the loop; RunData; Ctrl-C and
                 lost nodes reported with the checkpoint a rerun continues from
    preflight.py checks of local files before Ray and before run_dir is written (weights, resume
                 target, data_source rewards, GPUs, run_dir)
    batching.py  prompts + completions → the training batch; responses → text; outcome rewards
    metrics.py   phase timers, step metrics, console/progress bar, JSONL, TensorBoard, plots
    state.py     checkpoint directories, manifests, driver state, the intact checkpoint to resume from
                 (damaged ones reported and passed over), crash-safe pruning
    fault_soak.py, fault_points.py  the fault soak: kill a short run at random points, rerun, compare

Entry point: `megarl train --config configs/grpo_quickstart.yaml [dotted.overrides=...]`.
The roles themselves live in `megarl.workers`, the driver's handles on them in `megarl.controller`.
Importing this package imports neither Ray, megatron nor vLLM.
"""

from megarl.trainer.run import RunData, load_run_data, train

__all__ = ["RunData", "load_run_data", "train"]
