"""megarl: a Megatron-Core-centric RLHF pipeline (PPO, GRPO) with vLLM rollout and Ray orchestration.

Packages: `models` (HF ↔ megatron-core bridge and conversion), `data` (batch type, prompt
datasets, balancing), `algorithms` (advantages, losses, KL), `rewards` (rule, sandboxed code and
model rewards), `utils`. Importing `megarl` imports nothing heavy; it defers torch.compile's cost
in this process's first import of megatron.core (`megarl.utils.lazy_compile`) and keeps transformers'
import-time file scans in a cache (`megarl.utils.import_cache`); vLLM's import leaves inductor's lowering
to its first use (`megarl.utils.lazy_lowering`). It also keeps dependencies' warnings that tell a megarl user
nothing off the console (`megarl.utils.quiet`).
"""

from megarl.utils import import_cache as _import_cache
from megarl.utils import lazy_compile as _lazy_compile
from megarl.utils import lazy_lowering as _lazy_lowering
from megarl.utils import quiet as _quiet

__version__ = "0.1.0"
_lazy_compile.install()
_import_cache.install()
_lazy_lowering.install()
_quiet.install()
