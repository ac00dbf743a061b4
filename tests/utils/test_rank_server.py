"""`megarl convert` starts the server its ranks are forked from before it imports torch
(`megarl.utils.rank_server.start_early`) and runs its work in a child of that server (`run_in_server`), whose
ranks fork from it, with what they inherit frozen (out of their garbage collections); the command's own
process imports no torch."""

import subprocess
import sys
import textwrap
from pathlib import Path

from megarl.utils import rank_server

REPO = Path(__file__).resolve().parents[2]


def test_the_early_server_is_started_without_torch_and_forks_the_ranks():
    script = textwrap.dedent(
        """
        import os, sys
        from multiprocessing import forkserver
        from megarl.utils import rank_server
        assert rank_server.start_early()
        assert "torch" not in sys.modules, "imported before the server"
        server = forkserver._forkserver._forkserver_pid
        assert server is not None
        from megarl.utils.distributed import run_distributed
        parents = run_distributed(os.getppid, 2)
        assert parents == [server, server], (parents, server)
        import gc  # what a rank inherits from the server stays out of its garbage collections
        assert min(run_distributed(gc.get_freeze_count, 2)) > 100_000
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_a_command_runs_in_a_child_of_the_server_that_forks_its_ranks_while_it_imports_no_torch(tmp_path):
    script = tmp_path / "command.py"  # a file, not -c: the child finds `work` in it by name
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            from megarl.utils import rank_server

            def work():
                from megarl.utils.distributed import run_distributed
                return os.getpid(), os.getppid(), rank_server.in_server_child(), run_distributed(os.getppid, 2)

            if __name__ == "__main__":
                from multiprocessing import forkserver
                assert rank_server.start_early() and not rank_server.in_server_child()
                child, parent, flagged, rank_parents = rank_server.run_in_server(work)
                server = forkserver._forkserver._forkserver_pid
                assert parent == server and flagged and rank_parents == [child, child], (parent, server, rank_parents)
                assert "torch" not in sys.modules, "the command's process imported torch"
                try:
                    rank_server.run_in_server(sys.exit, 3)
                except RuntimeError as err:
                    assert "exit code 3" in str(err), err
                else:
                    raise AssertionError("a child that died returned")
                print("ok")
            """
        )
    )
    run = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_no_early_server_under_torchrun_or_where_ranks_are_spawned(monkeypatch, tmp_path):
    from multiprocessing import forkserver

    before = forkserver._forkserver._forkserver_pid
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert rank_server.start_early() is False
    monkeypatch.delenv("RANK")
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(rank_server, "_GPU_DEVICE_FILES", (str(tmp_path / "nvidiactl"),))
    assert rank_server.start_early() is False
    assert forkserver._forkserver._forkserver_pid == before  # nothing started


NOISE = ("Warning:", "DEPRECATED", "deprecated")  # what megatron-core, torch and vLLM printed around a conversion


def test_the_convert_command_converts_prints_and_exits_with_its_code(tmp_path):
    """`python -m megarl.cli convert` (the console script's path: early server, then `os._exit` after the
    atexit handlers) writes a checkpoint that converts back bit for bit, prints its line and no dependency's
    warnings, and a bad input still exits 2 with its one-line error."""
    from safetensors.torch import load_file

    from megarl.testing.models import save_tiny_hf_model

    save_tiny_hf_model("llama", tmp_path / "hf", seed=3)
    cli = [sys.executable, "-m", "megarl.cli", "convert"]
    to_mcore = [*cli, "hf-to-mcore", "--hf-path", str(tmp_path / "hf"), "--mcore-path", str(tmp_path / "mcore")]
    run = subprocess.run(to_mcore, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "wrote megatron checkpoint" in run.stdout, run.stderr[-3000:]
    assert not any(noise in run.stderr for noise in NOISE), run.stderr  # megarl.utils.quiet
    back = [*cli, "mcore-to-hf", "--mcore-path", str(tmp_path / "mcore"), "--hf-path", str(tmp_path / "back")]
    run = subprocess.run(back, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "wrote HF checkpoint" in run.stdout, run.stderr[-3000:]
    assert not any(noise in run.stderr for noise in NOISE), run.stderr
    before = load_file(tmp_path / "hf" / "model.safetensors")
    after = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(before) == set(after) and all(before[k].equal(after[k]) for k in before)
    run = subprocess.run(to_mcore, capture_output=True, text=True, timeout=300)  # the target exists now
    assert run.returncode == 2 and "--overwrite" in run.stderr and "Traceback" not in run.stderr, run.stderr
