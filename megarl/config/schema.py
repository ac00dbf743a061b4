"""The typed configuration of a run: one dataclass tree, every knob with its default and a docstring.

`RunConfig` is the root. Sections reuse the dataclasses their owners define (no duplicated
fields): `data: DataConfig` (megarl.data), `reward: RewardConfig` (megarl.rewards), the role configs
extend the engine's `EngineConfig` (layout, dtype, micro_batch_tokens, optim, ...), and
`algorithm` holds `AdvantageConfig`, `PolicyLossConfig`, `KLConfig`, `ValueLossConfig`,
`DAPOConfig` and `MismatchConfig` from megarl.algorithms.

Batch sizes carry their unit: `trainer.prompts_per_step`, `rollout.samples_per_prompt`,
`actor.prompts_per_update`, `actor.micro_batch_tokens`. Sizes derived from them (samples per step,
DP sizes, updates per step) are computed in one place, `megarl.config.validate.derive`.

Imports torch (through megarl.algorithms) but never megatron, vLLM or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megarl.agent.config import AgentConfig
from megarl.algorithms.advantages import AdvantageConfig
from megarl.algorithms.dapo import DAPOConfig
from megarl.algorithms.kl import KLConfig
from megarl.algorithms.mismatch import MismatchConfig
from megarl.algorithms.policy_loss import PolicyLossConfig
from megarl.algorithms.value_loss import ValueLossConfig
from megarl.data.datasets import DataConfig
from megarl.engine.config import EngineConfig, OptimConfig
from megarl.rewards.runner import RewardConfig

ROLLOUT_ENGINES = ("auto", "vllm", "embedded")
ROLLOUT_MODES = ("colocated", "server")
ACCELERATORS = ("gpu", "cpu")
RESUME_MODES = ("auto", "never")
TRAINER_MODES = ("sync", "async")
OVER_STALE = ("pace", "drop")
ON_UPDATE = ("continue", "abort")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
MAIN_POOL = "main"


# ----------------------------------------------------------------------------- run-level sections


@dataclass
class TrainerConfig:
    """The RL loop: how many steps, batch size in prompts, seeding, run directory, checkpoints, logs."""

    total_steps: int = 100
    """RL steps to run (one step: generate, score, update the actor (and critic), sync weights)."""
    prompts_per_step: int = 32
    """Prompts per RL step; the step trains on prompts_per_step * rollout.samples_per_prompt samples."""
    seed: int = 42
    """Seed of the driver (dataloader order, sampling seeds); roles seed their own RNGs from it."""
    run_dir: str = "runs/megarl"
    """Directory of the run: config.yaml, checkpoints/, metrics.jsonl, tensorboard/, rollouts/."""
    resume: str = "auto"
    """auto: continue from the latest checkpoint in run_dir if there is one; never; or a checkpoint path."""
    checkpoint_every_steps: int = 50
    """Save a checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_checkpoints: int = 2
    """Checkpoints kept in run_dir (oldest deleted first); 0 keeps all."""
    checkpoint_async: bool = False
    """Write checkpoints while training goes on: a save copies the state (GPU: to host memory, which then
    holds a copy of every rank's share until it is written) and the next steps run while the files are
    written; the checkpoint counts once written (checked as each step starts training). A run stopped
    meanwhile continues from the one before."""
    checkpoint_reshardable: bool = True
    """Save the optimizer state so that any TP/PP/EP/DP layout can resume from it (megatron-core gathers it
    over the DP ranks at every save); false: each rank writes its own shard as it holds it, with no
    communication (several times faster, less host memory), and a resume may change the DP size only."""
    export_hf_at_end: bool = True
    """Write the final actor as a HuggingFace checkpoint to run_dir/hf."""
    log_every_steps: int = 1
    """Log metrics every this many steps."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console, jsonl (run_dir/metrics.jsonl), tensorboard, wandb."""
    dump_rollouts_every_steps: int = 10
    """Write the step's prompts, responses and rewards to run_dir/rollouts/step_N.jsonl; 0: never."""
    progress_bar: bool = True
    """Show a progress bar over steps on the console."""
    project: str = "megarl"
    """Project name (wandb)."""
    experiment: str = "run"
    """Experiment name (wandb, console header)."""
    mode: str = "sync"
    """sync: generate, then train, every step; async: generation overlaps training (`async_training`;
    needs rollout.mode=server)."""

    val_only: bool = False
    """Only evaluate: load what trainer.resume points at (auto: the latest checkpoint in run_dir, if any;
    never: model.hf_path, the initial policy; or a checkpoint path), validate once, log it at that step
    (appended to metrics.jsonl) and exit without training. Needs validation.files."""
    zero_variance_warn_steps: int = 10
    """Warn (once) when more than half of the prompt groups of every step had the same reward for all of
    their samples (rollout/zero_variance_groups > 0.5: group baselines give them zero advantage) this many
    steps in a row; 0: never."""


@dataclass
class AsyncConfig:
    """Asynchronous training (trainer.mode=async): rollouts stream into a buffer while the trainer trains."""

    max_staleness: int = 1
    """Policy versions a trained token may lag the trainer (AReaL's max_head_offpolicyness); 0: synchronous."""
    max_concurrent_rollouts: Optional[int] = None
    """Trajectories in flight; None: prompts_per_step * samples_per_prompt * (max_staleness + 1)."""
    over_stale: str = "pace"
    """pace: admission stops so nothing gets too stale; drop: too-stale groups are dropped (counted, resubmitted)."""
    on_update: str = "abort"
    """At a weight update in-flight requests are aborted and rerun on the new weights (abort) or continue on
    them (continue: partial rollout, the per-token versions show the switch, no decoding wasted)."""


@dataclass
class ValidationConfig:
    """Held-out prompts scored every few steps (the reward curve newcomers look at)."""

    files: list[str] = field(default_factory=list)
    """Validation prompt files (same format and columns as data.files); empty: no validation."""
    every_steps: int = 10
    """Validate every this many steps; 0: never (except before_train / at the end)."""
    before_train: bool = True
    """Validate once before the first step (the baseline of the curve)."""
    greedy: bool = True
    """Greedy decoding; false samples at validation.temperature / top_p / top_k."""
    temperature: Optional[float] = None
    """Sampling temperature when greedy=false; None: rollout.temperature."""
    top_p: Optional[float] = None
    """Nucleus threshold when greedy=false; None: rollout.top_p."""
    top_k: Optional[int] = None
    """Top-k when greedy=false; None: rollout.top_k."""
    samples_per_prompt: int = 1
    """Responses per validation prompt (n). val/acc and val/score are means over all responses (mean@n);
    with n > 1 also val/acc/mean@n and val/acc/pass@n (share of prompts with a right response).
    >1 only makes sense with greedy=false."""
    max_prompts: Optional[int] = None
    """Use only the first this many validation prompts; None: all."""


@dataclass
class ModelConfig:
    """The policy model every role starts from."""

    hf_path: str = ""
    """HuggingFace checkpoint directory (config.json + safetensors) of the initial policy."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory; None: hf_path."""


# ----------------------------------------------------------------------------- roles


@dataclass
class RoleConfig(EngineConfig):
    """A Megatron role: the engine's knobs (layout, dtype, micro_batch_tokens, ...) plus placement."""

    pool: str = MAIN_POOL
    """Resource pool (resources.pools) whose processes hold this role; roles in one pool share processes."""
    offload: bool = False
    """Move this role's parameters (grads, optimizer state) to host memory while other phases run."""


@dataclass
class TrainableRoleConfig(RoleConfig):
    """A role with an optimizer: how a step's samples become optimizer steps."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    prompts_per_update: Optional[int] = None
    """Prompts (with all their samples) per optimizer step; None: trainer.prompts_per_step (one update)."""
    epochs_per_step: int = 1
    """Passes over the step's samples (PPO epochs); updates per step = epochs * prompts_per_step / prompts_per_update."""


@dataclass
class ActorConfig(TrainableRoleConfig):
    """The policy being trained (initialised from model.hf_path)."""


@dataclass
class CriticConfig(TrainableRoleConfig):
    """The value model (same backbone + scalar head); needed by GAE."""

    enabled: bool = False
    """Build a critic (required by advantage estimators that read values, e.g. gae)."""
    hf_path: Optional[str] = None
    """Initial critic checkpoint; None: model.hf_path with a freshly initialised value head."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and learning-rate schedule (critics usually take a larger lr than the actor)."""


@dataclass
class RefConfig(RoleConfig):
    """The frozen reference policy the KL terms are measured against."""

    enabled: Optional[bool] = None
    """None: built exactly when a KL term is on (algorithm.kl_reward.coef or kl_loss.coef > 0)."""
    hf_path: Optional[str] = None
    """Reference checkpoint; None: model.hf_path."""


@dataclass
class RewardModelConfig(RoleConfig):
    """A Megatron reward model scoring each response (model-based reward, beside or instead of rules)."""

    enabled: bool = False
    """Score responses with a reward model (added to the rule reward when both exist)."""
    hf_path: Optional[str] = None
    """Reward-model checkpoint (a sequence-classification or causal-LM HF directory); required when enabled."""
    weight: float = 1.0
    """Multiplier of the model score in the total reward."""


# ----------------------------------------------------------------------------- rollout, algorithm, resources


@dataclass
class RolloutConfig:
    """Generation: engine, placement, sampling."""

    engine: str = "auto"
    """vllm, embedded (transformers in the worker process: no engine process, a sync lands in place; on CPU
    with small models faster than vLLM: the GRPO quickstart's generation 31 against 80 ms a step), or auto
    (vllm where it imports, else embedded)."""
    mode: str = "colocated"
    """colocated: engines share the actor's GPUs (sleep during training); server: engines on their own pool."""
    pool: str = MAIN_POOL
    """Resource pool of the engines (must be the actor's pool when colocated, another one as server)."""
    tp: int = 1
    """Tensor-parallel size of one engine; engines = pool GPUs / tp."""
    samples_per_prompt: int = 8
    """Responses sampled per prompt (the GRPO group size)."""
    max_response_tokens: int = 512
    """Longest response, in tokens."""
    temperature: float = 1.0
    """Sampling temperature (log-probs for training are taken at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1 disables."""
    top_k: int = 0
    """Top-k sampling; 0 disables."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory vLLM may take (weights + KV cache)."""
    max_model_len: Optional[int] = None
    """Engine context length; None: data.max_prompt_tokens + max_response_tokens."""
    enforce_eager: Optional[bool] = None
    """Disable CUDA graphs; None: eager on CPU, graphs on GPU."""
    dtype: str = "auto"
    """Engine dtype: auto (the actor's), float32, bfloat16, float16."""
    verify_weights: bool = True
    """Weight updates that move bytes to another process (vLLM's core by IPC, engine servers by broadcast)
    carry per-tensor checksums the engine checks before loading; a mismatch fails the update naming the
    tensor. false: skip the check (on CPU about a third of a copy of the weights on each side)."""
    delta_weights: bool = False
    """rollout.mode=server: after the first update, 16-bit (bf16/fp16) buckets travel as the elements whose
    bits changed (int32 index + value; whole when that is not smaller). Costs a copy of those weights on
    the sending trainer rank and on every server; pays where the network is slower than memory and
    the learning rate small (most bf16 weights keep their bits from one step to the next). Engine servers
    on the trainer's host (CPU, gloo) read every update from its shared memory instead, whole: no wire."""
    sync_bucket_mb: int = 256
    """The weight sync's bucket (MiB of gathered HF tensors): a rollout rank holds up to three in flight (two
    packed shares on a sender), and each bucket costs a few launches or messages. On one H200 the colocated
    sync of a 1.5 B model moved 0.35x a device copy's bytes/s in 256 MiB buckets, 0.50x in 1024 (launch-bound:
    `benchmarks/sync_device.py --bucket-mb`, 2026-12-04)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Agent loops (multi-turn tools, environments): which loop, its limits, the tool YAML. A row's
    `agent_name` column picks its loop; the default, single_turn, is one completion per sample.
    Its response-token budget is rollout.max_response_tokens."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm: PPO and GRPO (and their variants) differ only here."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage estimator (name + gamma, lam, whitening, group normalisation)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss (name + clip ratios, dual clip)."""
    value_loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    """Critic loss (value clipping)."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    kl_reward: KLConfig = field(default_factory=lambda: KLConfig(estimator="k1"))
    """KL penalty folded into the token rewards (PPO style); coef 0: off."""
    kl_loss: KLConfig = field(default_factory=lambda: KLConfig(estimator="k3"))
    """KL term added to the actor loss (GRPO style); coef 0: off."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient in the actor loss; 0: off."""
    critic_warmup_steps: int = 0
    """Steps in which only the critic trains (the actor starts after them)."""
    dapo: DAPOConfig = field(default_factory=DAPOConfig)
    """DAPO: dynamic sampling (filter zero-variance groups) and overlong-response shaping."""
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    """Rollout/train log-prob mismatch correction (truncated importance weights)."""


@dataclass
class ResourceConfig:
    """The machines: nodes, GPUs per node, and how they are cut into pools of colocated roles."""

    nodes: int = 1
    """Nodes in the Ray cluster used by this run."""
    gpus_per_node: int = 8
    """GPUs per node (accelerator=cpu: worker processes per node)."""
    accelerator: str = "gpu"
    """gpu, or cpu (gloo backend, megatron CPU patches; tests and the quickstart)."""
    pools: dict[str, int] = field(default_factory=dict)
    """GPUs per named pool, e.g. {main: 48, rollout: 16}; empty: one pool 'main' with every GPU."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each worker process."""
    placement_strategy: str = "PACK"
    """Ray placement-group strategy of a pool's node-sized bundles (PACK, SPREAD, STRICT_SPREAD)."""
    ray_address: Optional[str] = None
    """Ray cluster to join ('auto' under the sbatch script); None: start a local one."""
    fork_workers: bool = True
    """A local CPU run's worker processes fork from one process that imported torch, megatron-core,
    transformers (and vLLM) once, while the driver checked the run (`megarl.controller.fork_server`); false:
    Ray starts each from a fresh interpreter. Not used when joining a cluster (ray_address) or on GPUs."""
    bind_cpus: bool = True
    """accelerator=cpu: each worker process keeps to its share of its node's CPUs (by local rank), and so do the
    threads and processes it starts (its vLLM engine core); false: every process may run on every CPU. Not used
    on GPUs."""
    gpu_peak_tflops: float = 989.0
    """Dense bf16 peak TFLOP/s of one GPU, the denominator of MFU (H100/H200 SXM: 989; A100: 312)."""


# ----------------------------------------------------------------------------- root


@dataclass
class RunConfig:
    """Everything a run needs; YAML files and command-line overrides only change these defaults."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop: steps, prompts per step, seed, run directory, checkpoints, logging."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The initial policy checkpoint and tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training prompts: files, columns, prompt length, truncation, shuffling."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Validation prompts and schedule."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy's Megatron engine and optimizer."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (PPO / GAE)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy (KL terms)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """An optional model-based reward."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rule-based rewards: which function, worker pool, timeouts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engines and sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, losses, KL, DAPO, mismatch correction."""
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    """Nodes, GPUs and pools."""
    async_training: AsyncConfig = field(default_factory=AsyncConfig)
    """Asynchronous training's staleness bound and update behaviour (trainer.mode=async)."""
