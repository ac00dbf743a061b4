import socket
import subprocess
import sys
import threading

import pytest

from megarl.rewards import get_reward_fn
from megarl.rewards.sandbox import SandboxConfig, network_namespace_prefix, run_python


def test_program_reads_stdin_and_writes_stdout():
    result = run_python("print(sum(map(int, input().split())))", stdin="2 3\n")
    assert result.ok and result.stdout == "5\n"


def test_infinite_loop_killed_at_time_limit():
    result = run_python("while True:\n    pass\n", config=SandboxConfig(timeout_s=1.0))
    assert result.timed_out and not result.ok
    assert 0.9 < result.duration_s < 3.0


def test_infinite_loop_child_processes_cannot_be_spawned():
    result = run_python("import subprocess\nsubprocess.run(['sleep', '60'])\n")
    assert result.returncode != 0 and "subprocess.Popen is refused" in result.stderr


def test_memory_bomb_stopped_with_memory_error():
    code = "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))\n"
    result = run_python(code, config=SandboxConfig(memory_mb=256, timeout_s=10))
    assert not result.timed_out and result.returncode != 0
    assert "MemoryError" in result.stderr


@pytest.fixture
def listening_server():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.3)
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    yield server.getsockname()[1], accepted, thread
    thread.join()
    server.close()


CONNECT = "import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\nprint('connected')\n"


@pytest.mark.parametrize("network_namespace", [True, False])
def test_socket_connect_to_local_server_refused(listening_server, network_namespace):
    port, accepted, thread = listening_server
    config = SandboxConfig(network_namespace=network_namespace)
    result = run_python(CONNECT.format(port=port), config=config)
    thread.join()
    assert result.returncode != 0 and "connected" not in result.stdout
    assert "socket.connect is refused" in result.stderr
    assert accepted == []


def test_network_namespace_alone_cannot_reach_host_loopback(listening_server):
    prefix = network_namespace_prefix()
    if not prefix:
        pytest.skip("no usable `unshare --net` on this machine (the audit hook still refuses sockets)")
    port, accepted, thread = listening_server
    proc = subprocess.run([*prefix, sys.executable, "-c", CONNECT.format(port=port)], capture_output=True, text=True)
    thread.join()
    assert proc.returncode != 0 and accepted == []


def test_write_outside_sandbox_dir_refused(tmp_path):
    target = tmp_path / "owned_by_test.txt"
    target.write_text("original")
    code = (
        f"try:\n    open({str(target)!r}, 'w').write('pwned')\nexcept PermissionError as e:\n    print('refused', e)\n"
        f"open({str(tmp_path / 'new.txt')!r}, 'x')\n"
    )
    result = run_python(code)
    assert "refused" in result.stdout and result.returncode != 0
    assert target.read_text() == "original"
    assert not (tmp_path / "new.txt").exists()


def test_remove_rename_and_rmtree_outside_sandbox_dir_refused(tmp_path):
    target = tmp_path / "keep.txt"
    target.write_text("keep")
    for stmt in (
        f"os.remove({str(target)!r})",
        f"os.rename({str(target)!r}, 'stolen.txt')",
        f"shutil.rmtree({str(tmp_path)!r})",
        f"os.symlink({str(target)!r}, 'l'); open('l', 'w')",
    ):
        result = run_python(f"import os, shutil\n{stmt}\n")
        assert "PermissionError" in result.stderr, stmt
    assert target.read_text() == "keep"


def test_files_inside_sandbox_dir_are_writable():
    result = run_python(
        "open('out.txt', 'w').write('hi')\nprint(open('out.txt').read())\nimport os\nos.remove('out.txt')\n"
    )
    assert result.ok and result.stdout == "hi\n"


CASES = (
    '[{"input": "1 2\\n", "output": "3\\n"}, {"input": "5 5\\n", "output": "10"}, {"input": "0 0\\n", "output": "0"}]'
)


def test_code_reward_scores_fraction_of_cases_passed():
    fn = get_reward_fn("code")
    right = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert fn(right, CASES, {})["score"] == 1.0
    partly = "```python\na, b = map(int, input().split())\nprint(a + b if a else 1)\n```"
    assert fn(partly, CASES, {})["score"] == pytest.approx(2 / 3)


def test_code_reward_without_code_block_or_with_hang_scores_zero():
    fn = get_reward_fn("code")
    assert fn("print(3)", CASES, {})["score"] == 0.0
    hang = fn("```python\nwhile True: pass\n```", CASES, {"timeout_s": 0.5})
    assert hang["score"] == 0.0


def test_code_reward_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="JSON list"):
        get_reward_fn("code")("```python\nprint(1)\n```", '{"x": 1}', {})
