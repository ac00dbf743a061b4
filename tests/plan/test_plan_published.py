"""Published layouts must be predicted to fit, impossible ones not (issue 16, item 3b).

Sources (example scripts / configs as their repositories ship them; layouts copied into megarl's
config terms below):
* verl, examples/grpo_trainer/run_qwen2_5-7b_math_megatron.sh (commit d01c2688): Qwen2.5-7B-Instruct,
  actor TP4 PP2 VPP2 with gradient checkpointing, vLLM TP2 at gpu_memory_utilization 0.6, n=5,
  1024 + 1024 tokens, 4 sequences (8192 tokens) per micro-batch, KL loss (reference model);
  one model copy = 8 GPUs.
* NeMo-RL, examples/configs/grpo_math_70B_megatron.yaml (commit 06f63430): Llama-3.3-70B-Instruct on
  8 nodes x 8 GPUs, TP4 PP4, vLLM TP4 at 0.6, 4096-token sequences, one sequence per micro-batch;
  NeMo-RL moves the policy (and the reference) to host memory while vLLM generates.
* verl, examples/grpo_trainer/run_qwen3moe-30b_megatron.sh (commit 3f388066): Qwen3-30B-A3B on
  4 nodes x 8 GPUs, TP4 PP2 EP4 with gradient checkpointing, vLLM TP4 at 0.6, n=5, 1024 + 2048
  tokens, 4 sequences per micro-batch, KL loss.
* NeMo-RL, examples/configs/grpo_dapomath17k_dsv3_megatron.yaml (commit 37971e6a): DeepSeek-V3 on
  64 nodes x 8 GPUs, TP8 PP16 CP4 EP32 with expert TP 1, fp32 parameters, activation checkpointing,
  16384-token sequences, vLLM TP32 at 0.6, policy offloaded during generation. megarl ties expert
  TP to TP, so this layout is checked with the memory model directly (`Shard(etp=1)`).
(slime's scripts/run-qwen3-30B-A3B.sh on 8xH100 relies on CPU Adam, which megarl does not have.)
"""

from pathlib import Path

from megarl.config import load_config
from megarl.plan import gpu_spec, plan_run
from megarl.plan.memory import CONTEXT_BYTES, VLLM_NON_TORCH_BYTES, Shard, role_memory, vllm_memory
from megarl.plan.presets import PRESETS

H100 = gpu_spec("H100")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _run(model, gpus, prompts, n, prompt, response, actor, rollout_tp, **extra):
    nodes = max(1, gpus // 8)
    overrides = [
        f"model.hf_path={model}",
        "data.files=[x.parquet]",
        f"trainer.prompts_per_step={prompts}",
        f"rollout.samples_per_prompt={n}",
        f"data.max_prompt_tokens={prompt}",
        f"rollout.max_response_tokens={response}",
        f"rollout.tp={rollout_tp}",
        "rollout.gpu_memory_utilization=0.6",
        f"resources.nodes={nodes}",
        "resources.gpus_per_node=8",
        "actor.dtype=bfloat16",
        "ref.dtype=bfloat16",
    ]
    overrides += [f"actor.{k}={v}" for k, v in actor.items()] + [
        f"ref.{k}={v}" for k, v in actor.items() if k in ("layout", "micro_batch_tokens")
    ]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return load_config((), overrides)


def test_verl_qwen2_5_7b_on_8_gpus_fits():
    cfg = _run(
        "Qwen2.5-7B-Instruct",
        8,
        1024,
        5,
        1024,
        1024,
        {
            "layout": "{tp: 4, pp: 2, vpp: 2}",
            "recompute": "true",
            "micro_batch_tokens": 8192,
            "prompts_per_update": 256,
        },
        2,
        **{"algorithm.kl_loss.coef": 0.001},
    )
    plan = plan_run(cfg, PRESETS["qwen2.5-7b-instruct"], H100)
    assert set(plan.roles) == {"actor", "ref"}
    assert plan.fits, plan.warnings


def test_nemo_rl_llama_70b_on_64_gpus_fits():
    cfg = _run(
        "Llama-3.3-70B-Instruct",
        64,
        64,
        32,
        1024,
        3072,
        {"layout": "{tp: 4, pp: 4}", "offload": "true", "micro_batch_tokens": 4096, "prompts_per_update": 16},
        4,
        **{"algorithm.kl_loss.coef": 0.01, "ref.offload": "true"},
    )
    plan = plan_run(cfg, PRESETS["llama-3.3-70b-instruct"], H100)
    assert plan.fits, plan.warnings


def test_verl_qwen3_30b_a3b_on_32_gpus_fits():
    cfg = _run(
        "Qwen3-30B-A3B",
        32,
        64,
        5,
        1024,
        2048,
        {"layout": "{tp: 4, pp: 2, ep: 4}", "recompute": "true", "micro_batch_tokens": 12288},
        4,
        **{"algorithm.kl_loss.coef": 0.001},
    )
    plan = plan_run(cfg, PRESETS["qwen3-30b-a3b"], H100)
    assert plan.fits, plan.warnings


def test_nemo_rl_deepseek_v3_sized_on_512_gpus_fits():
    dims = PRESETS["deepseek-v3-sized"]
    shard = Shard(tp=8, pp=16, cp=4, ep=32, etp=1, dp=1, edp=1)
    train = role_memory(dims, shard, dtype_bytes=4, trainable=True, recompute=True, tokens=16384, micro_batches=16)
    vllm = vllm_memory(dims, 32, H100.hbm_bytes, 0.6, 16384)
    assert train.peak + CONTEXT_BYTES + VLLM_NON_TORCH_BYTES < H100.hbm_bytes, train
    assert vllm.budget + CONTEXT_BYTES < H100.hbm_bytes and vllm.sequences >= 1, vllm
    # the same model unsharded over experts (EP1) cannot hold its experts on one GPU
    crowded = role_memory(dims, Shard(tp=8, pp=16, cp=4, etp=1), trainable=True, recompute=True, tokens=16384)
    assert crowded.weights > H100.hbm_bytes


def test_70b_actor_at_tp1_is_predicted_not_to_fit():
    cfg = load_config(
        CONFIGS / "llama3-70b_ppo.yaml",
        [
            "actor.layout={tp: 1, pp: 1, vpp: 1}",
            "critic.layout={tp: 1, pp: 1}",
            "ref.layout={tp: 1, pp: 1}",
            "rollout.tp=8",
        ],
    )
    plan = plan_run(cfg, PRESETS["meta-llama-3-70b-instruct"], H100)
    assert not plan.fits and plan.margin < 0
    assert plan.roles["actor"].weights > H100.hbm_bytes  # 70B bf16 weights alone are 141 GB
    assert any("actor update" in w for w in plan.warnings)


def test_more_hbm_turns_a_tight_layout_into_a_fitting_one():
    cfg = load_config(CONFIGS / "qwen2.5-7b_grpo_gsm8k.yaml", ["actor.layout={tp: 1}", "ref.layout={tp: 1}"])
    small = plan_run(cfg, PRESETS["qwen2.5-7b-instruct"], gpu_spec("H100"))
    big = plan_run(cfg, PRESETS["qwen2.5-7b-instruct"], gpu_spec("H200"))
    assert not small.fits and big.fits
