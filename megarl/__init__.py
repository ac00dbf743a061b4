"""megarl: a Megatron-Core-centric RLHF pipeline (PPO, GRPO) with vLLM rollout and Ray orchestration.

Packages: `models` (HF ↔ megatron-core bridge and conversion), `data` (batch type, prompt
datasets, balancing), `algorithms` (advantages, losses, KL), `rewards` (rule, sandboxed code and
model rewards), `utils`. Importing `megarl` imports nothing heavy.
"""

__version__ = "0.1.0"
