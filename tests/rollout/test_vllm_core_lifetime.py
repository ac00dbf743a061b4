"""A forked vLLM engine core dies with the process that started it, even when that process is killed
(no atexit shutdown): a script using `VLLMEngine` is SIGKILLed and its core must be gone within seconds.
At rollout TP 1 on CPU that core is the engine's only process (no vLLM worker beside it)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megarl.rollout import vllm_available
from megarl.testing.processes import TAG_VAR, kill_tagged, tagged, wait_until_gone

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")

SCRIPT = textwrap.dedent("""
    import sys, time
    from megarl.rollout.vllm_engine import VLLMEngine
    engine = VLLMEngine(sys.argv[1], cpu_kv_cache_bytes=16 << 20)
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_killed_engine_owner_takes_its_forked_core_along(rollout_models):
    tag = f"vllm-core-{os.getpid()}-{time.time_ns()}"
    owner = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(rollout_models["qwen2"])],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={k: v for k, v in {**os.environ, TAG_VAR: tag}.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
    )
    try:
        for line in owner.stdout:  # vLLM logs to stdout as well
            if line.strip() == "ready":
                break
        else:
            pytest.fail(f"the engine did not start (exit code {owner.wait()})")
        others = [command for pid, command in tagged(tag) if pid != owner.pid]
        # at TP 1 on CPU the core runs the model itself: no vLLM worker process beside it
        assert others == ["VLLM::EngineCore"], others
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        left = wait_until_gone(tag, timeout_s=10)
        assert not left, f"outlived the process that started them: {left}"
    finally:
        owner.kill()
        kill_tagged(tag)
