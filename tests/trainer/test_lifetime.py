"""Worker processes die with their parent, children included (megarl.utils.lifetime, installed in every
Ray worker as its setup hook), here without Ray: parent P starts worker W, W arms `die_with_parent`
and starts child C in a session of its own (so no process-group kill reaches it); P is SIGKILLed,
as a raylet is when its node or driver goes, and W and C must be gone within seconds."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from train_helpers import REPO

from megarl.testing.processes import TAG_VAR, kill_tagged, tagged, wait_until_gone

WORKER = textwrap.dedent("""
    import subprocess, sys, time
    from megarl.utils.lifetime import die_with_parent
    die_with_parent(poll_s=0.1)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(600)
""")
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
    time.sleep(600)
""")


def test_a_worker_kills_its_children_and_itself_when_its_parent_dies():
    tag = f"lifetime-{os.getpid()}-{time.time_ns()}"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, WORKER],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), TAG_VAR: tag},
    )
    try:
        child = int(parent.stdout.readline())
        assert child in {pid for pid, _ in tagged(tag)} and len(tagged(tag)) == 3  # parent, worker, child
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        left = wait_until_gone(tag, timeout_s=10)
        assert not left, f"outlived their parent: {left}"
    finally:
        kill_tagged(tag)
