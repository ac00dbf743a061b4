"""megarl.utils.quiet: dependencies' known noise is kept off the console; everything else still shows."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megarl.utils import rank_server

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, warnings
import megarl
import megatron.core.optimizer  # warns at import that Transformer Engine and Apex are not installed
warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
warnings.warn("Apex is not installed, and this is a message quiet does not know", UserWarning)
logging.basicConfig()
log = logging.getLogger("megatron.core.models.gpt.gpt_model")
log.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
log.warning("GPTModel built with another message")
"""


def _stderr(**env) -> str:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=180, env={**os.environ, **env}
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr


@pytest.mark.skipif(rank_server.gpu_machine(), reason="on GPUs the CUDA libraries' notes stay")
def test_known_warnings_and_log_records_are_dropped_on_a_cpu_machine_and_other_ones_from_the_same_code_stay():
    quiet_run, loud_run = _stderr(), _stderr(MEGARL_QUIET="0")
    for known in ("Transformer Engine and Apex are not installed", "Falling back to Torch Norm", "IS DEPRECATED"):
        assert known in loud_run, loud_run  # the script makes them, and MEGARL_QUIET=0 shows them
        assert known not in quiet_run, quiet_run
    for other in ("a message quiet does not know", "GPTModel built with another message"):
        assert other in quiet_run and other in loud_run, quiet_run


def test_a_models_transformer_config_builds_without_megatron_cores_cuda_graph_deprecation(tmp_path):
    """megatron-core 0.19's default `cuda_graph_modules="full"` warns at every build; megarl passes its equal, []."""
    from megarl.models.bridge import ModelBridge
    from megarl.testing.models import save_tiny_hf_model

    save_tiny_hf_model("llama", tmp_path, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ModelBridge.from_hf_path(tmp_path).transformer_config()
    assert not [w for w in caught if "full scope is deprecated" in str(w.message)], [str(w.message) for w in caught]
    assert config.cuda_graph_modules == []
