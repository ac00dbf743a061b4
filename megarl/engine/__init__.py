"""The Megatron training engine: per-role process groups, the engine, roles, log-probs, offload, checkpoints.

    parallel.py    RoleGroups / build_role_groups: a ProcessGroupCollection per role and layout
    logprobs.py    vocab-parallel log-prob + entropy (autograd), chunked over tokens
    micro.py       MicroBatch: unpadded rows packed by a token budget; DP sharding
    engine.py      MegatronEngine: bridge-built chunks, DDP, distributed optimizer, schedules
    roles.py       Actor, Reference, Critic, RewardModel (engine + head + loss)
    offload.py     parameters / grads / optimizer state to host memory and back
    checkpoint.py  atomic distributed checkpoints (model, optimizer, scheduler, RNG, step), HF export

Imports megatron-core lazily (inside functions); must not import vLLM or Ray.
"""
