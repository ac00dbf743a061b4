"""The Megatron training engine: per-role process groups, the engine, roles, log-probs, offload, checkpoints.

    parallel.py    RoleGroups / build_role_groups: a ProcessGroupCollection per role and layout
    logprobs.py    vocab-parallel log-prob + entropy (autograd), chunked over tokens
    micro.py       MicroBatch: unpadded rows packed by a token budget; DP sharding
    context.py     context parallelism: load-balanced sequence split per CP rank, gather back to rows
    engine.py      MegatronEngine: bridge-built chunks, DDP, distributed optimizer, schedules
    heads.py       LogProbHead, ValueHead, ScoreHead: model output -> per-token response tensors
    offload.py     parameters / grads / optimizer state to host memory and back
    checkpoint.py  atomic distributed checkpoints (model, optimizer, scheduler, RNG, step), HF export

Use (every process of the world, in the same order, since creating groups is collective):

    actor_groups = build_role_groups(ParallelLayout(tp=2))          # roles may share processes
    critic_groups = build_role_groups(ParallelLayout(tp=1))         # ... with their own layouts
    init_global_state(actor_groups)                                 # once per process
    engine = MegatronEngine(hf_path, EngineConfig(layout=..., optim=OptimConfig(lr=1e-6)), actor_groups)
    rows = shard_for_dp(batch, actor_groups.dp_size, actor_groups.dp_rank)
    engine.forward(rows, LogProbHead.of(engine))            # {"log_probs", "entropy"}: [B_local, T]
    engine.train_step(rows, LogProbHead.of(engine), loss_fn)  # {"loss", "grad_norm", "lr", stats, ...}
    engine.save_checkpoint(path); engine.offload(); engine.onload()

The roles that compose an engine with a head and a loss (Actor, Critic, ...) are `megarl.workers`.

On CPU (gloo, megatron_patches) everything above runs and is tested: TP, PP, virtual PP, DP with
the distributed optimizer, activation recompute, colocated roles with different layouts, offload,
checkpoint resharding. GPU-only, wired but not testable here: bf16 (EngineConfig.dtype "auto"),
Transformer Engine specs with sequence parallelism (micro-batch widths are padded to a multiple of
TP for it), pinned-memory offload.

Context parallelism (layout.cp > 1) needs Transformer Engine's attention (p2p ring, causal, BSHD
rows padded to a multiple of 2·cp, megatron's load-balanced split): without TE (any CPU machine)
`validate_engine_config` refuses it, naming layout.cp and the fix. Everything around the attention
is tested on CPU: the split and gather, the loss scaling over dp_cp, and the whole engine at CP=2
(updates, log-probs, a CP=2 → CP=1 checkpoint) with a test-only pure-torch attention standing in
for TE's (tests/engine/test_context_parallel.py). The TE run itself is covered by a GPU-only test
(tests/engine/test_context_parallel_gpu.py, 2 GPUs) that has not run in this project yet.
Not supported yet: expert parallelism (the bridge has no MoE families yet; dense models refuse ep > 1).

Imports megatron-core lazily (inside functions); must not import vLLM or Ray.
"""

from megarl.engine.config import EngineConfig, OptimConfig
from megarl.engine.engine import MegatronEngine, validate_engine_config
from megarl.engine.heads import LogProbHead, ScoreHead, ValueHead
from megarl.engine.micro import MicroBatch, shard_for_dp
from megarl.engine.parallel import RoleGroups, build_role_groups, init_global_state

__all__ = [
    "EngineConfig",
    "LogProbHead",
    "MegatronEngine",
    "MicroBatch",
    "OptimConfig",
    "RoleGroups",
    "ScoreHead",
    "ValueHead",
    "build_role_groups",
    "init_global_state",
    "shard_for_dp",
    "validate_engine_config",
]
