"""The signal side of stopping a command (megarl.utils.interrupts), in a plain Python child (Ray only where named):
SIGINT works even when inherited ignored, the first SIGINT/SIGTERM runs the graceful path, a second
one (or an overrunning graceful stop) exits at once with 128 + the signal."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from train_helpers import REPO

CHILD = textwrap.dedent("""
    import sys, time
    from megarl.utils.interrupts import GracefulStop, exit_code
    with GracefulStop(grace_s=float(sys.argv[1])):
        try:
            if sys.argv[3] == "ray":  # what `megarl train` does before its steps
                from megarl.config import load_config
                from megarl.controller import init_ray
                init_ray(load_config("configs/grpo_quickstart.yaml"), log_to_driver=False)
            print("ready", flush=True)
            time.sleep(60)
            sys.exit(0)
        except KeyboardInterrupt as err:
            print(f"graceful {type(err).__name__}", flush=True)
            time.sleep(float(sys.argv[2]))  # the graceful stop (workers, Ray) takes this long
            print("graceful done", flush=True)
            sys.exit(exit_code(err))
""")


def _start(grace_s: float, cleanup_s: float, ignore_sigint: bool, ray: bool = False):
    def preexec():  # what `cmd &` in a non-interactive shell does to the child
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(grace_s), str(cleanup_s), "ray" if ray else "plain"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=preexec,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = []
    while (line := proc.stdout.readline()) and line.strip() != "ready":  # Ray logs its start first
        lines.append(line)
    assert line.strip() == "ready", "".join(lines)
    return proc


@pytest.mark.parametrize(
    "signum,ignored",
    [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["sigint", "sigint-inherited-ignored", "sigterm"],
)
def test_first_signal_runs_the_graceful_stop_and_exits_128_plus_signal(signum, ignored):
    proc = _start(grace_s=30, cleanup_s=0.2, ignore_sigint=ignored)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum, out
    assert "graceful Interrupted" in out and "graceful done" in out, out


def test_sigterm_after_ray_init_still_runs_the_graceful_stop():
    """ray.init sets its own SIGTERM handler (exit at once; its C++ failure handler then aborted a
    SIGTERM'd `megarl train` with 134): init_ray puts the command's handlers back."""
    proc = _start(grace_s=30, cleanup_s=0.2, ignore_sigint=False, ray=True)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "graceful Interrupted" in out and "graceful done" in out, out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_second_signal_exits_at_once_during_a_slow_graceful_stop(signum):
    proc = _start(grace_s=30, cleanup_s=30, ignore_sigint=True)
    proc.send_signal(signum)
    assert proc.stdout.readline().startswith("graceful")
    start = time.perf_counter()
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signum and time.perf_counter() - start < 5, out
    assert "exiting at once" in out and "graceful done" not in out, out


def test_a_graceful_stop_that_overruns_its_grace_period_is_cut_short():
    proc = _start(grace_s=1.0, cleanup_s=30, ignore_sigint=False)
    start = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130 and time.perf_counter() - start < 10, out
    assert "took over 1 s: exiting at once" in out and "graceful done" not in out, out
