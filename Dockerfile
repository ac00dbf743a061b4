# megarl on the NGC PyTorch image: CUDA torch, Transformer Engine and apex come with the image;
# megatron-core, vLLM and Ray are pinned on top. Build: docker build -t megarl .
# Run:   docker run --gpus all --ipc=host --ulimit memlock=-1 -v /data:/data megarl megarl --help
FROM nvcr.io/nvidia/pytorch:25.10-py3

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_WORKER_MULTIPROC_METHOD=spawn

WORKDIR /opt/megarl
COPY requirements/ requirements/
# The image's torch / TE / apex must not be replaced: constrain torch to the installed build.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt && \
    pip install -c /tmp/torch-constraint.txt -r requirements/base.txt -r requirements/test.txt && \
    pip install --no-deps megatron-core==0.19.2 && \
    pip install -c /tmp/torch-constraint.txt "vllm>=0.10" "ray[default]>=2.50"

COPY . .
RUN pip install --no-deps -e . && python -c "import megarl, megatron.core; print('megarl ready')"
