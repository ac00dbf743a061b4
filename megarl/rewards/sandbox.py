"""Run untrusted Python code (model-written solutions) in a limited subprocess.

Owns `run_python`. Layers, all applied on every run:
* time: wall-clock limit; on expiry the whole process group is SIGKILLed (plus RLIMIT_CPU);
* memory: RLIMIT_AS, so a memory bomb ends in MemoryError; RLIMIT_FSIZE bounds file and output size;
* network: the process runs in a fresh network namespace (`unshare --net`, with
  `--map-root-user` when not root) when that works on this machine, and an audit hook refuses
  `socket.connect` / `bind` / `sendto` / DNS look-ups in any case;
* files: the cwd is a fresh temp dir (deleted afterwards); the audit hook refuses opening files
  for writing outside it, and removing, renaming, linking, chmod-ing outside it; spawning
  processes and `ctypes` symbol look-ups are refused (they would bypass the hook).
Audit hooks are best effort (CPython code can still do harm in ways they do not see): the
namespace and the rlimits are the hard limits. Run sandboxes as an unprivileged user where you
can. No imports beyond the standard library.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Runs inside the sandboxed interpreter (`python -I -B -c LAUNCHER solution.py`), before user code.
LAUNCHER = r"""
import os, sys, resource
_ROOT = os.path.realpath(os.environ.pop("MEGARL_SANDBOX_ROOT"))
_MEM = int(os.environ.pop("MEGARL_SANDBOX_MEM"))
_FSIZE = int(os.environ.pop("MEGARL_SANDBOX_FSIZE"))
_CPU = int(os.environ.pop("MEGARL_SANDBOX_CPU"))
for _lim, _val in ((resource.RLIMIT_AS, _MEM), (resource.RLIMIT_FSIZE, _FSIZE),
                   (resource.RLIMIT_CPU, _CPU), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(_lim, (_val, _val))

def _make_hook(root, realpath=os.path.realpath, fsdecode=os.fsdecode, sep=os.sep):
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    refused = frozenset(("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
        "socket.gethostbyaddr", "socket.getnameinfo", "subprocess.Popen", "os.system",
        "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn",
        "os.kill", "os.killpg", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function"))
    path_args = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
        "os.chmod": (0,), "os.chown": (0,), "os.link": (1,), "os.symlink": (1,),
        "os.truncate": (0,), "os.utime": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
        "os.setxattr": (0,), "os.removexattr": (0,), "os.chflags": (0,), "shutil.rmtree": (0,),
        "shutil.move": (0, 1), "shutil.copyfile": (1,), "shutil.copytree": (1,),
        "shutil.chown": (0,), "shutil.unpack_archive": (1,), "shutil.make_archive": (0,)}

    def inside(path):
        if isinstance(path, int) or path is None:
            return True
        full = realpath(fsdecode(path))
        return full == root or full.startswith(root + sep) or full == "/dev/null"

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox dir is refused")
        elif event in path_args:
            if not all(inside(args[i]) for i in path_args[event] if i < len(args)):
                raise PermissionError(f"sandbox: {event} outside the sandbox dir is refused")
        elif event in refused:
            raise PermissionError(f"sandbox: {event} is refused")
    return hook

sys.addaudithook(_make_hook(_ROOT))
del _make_hook, _lim, _val, _ROOT, _MEM, _FSIZE, _CPU
import runpy
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass
class SandboxConfig:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock limit in seconds; the process group is killed when it is reached."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) in MiB; allocations beyond it raise MemoryError."""
    max_file_mb: int = 16
    """Largest file (and stdout/stderr) the code may write, in MiB (RLIMIT_FSIZE)."""
    max_output_chars: int = 100_000
    """stdout/stderr are cut to this many characters in the result."""
    network_namespace: bool = True
    """Run inside a fresh network namespace (`unshare --net`) when this machine allows it."""
    python: str = sys.executable
    """Interpreter that runs the code."""


@dataclass
class SandboxResult:
    """What a sandboxed run produced."""

    stdout: str
    """Captured standard output (cut to `max_output_chars`)."""
    stderr: str
    """Captured standard error (cut to `max_output_chars`)."""
    returncode: int | None
    """Exit status (negative: killed by that signal); None when it timed out."""
    timed_out: bool
    """True when the wall-clock limit killed it."""
    duration_s: float
    """Wall-clock seconds the run took."""

    @property
    def ok(self) -> bool:
        """Exited by itself with status 0."""
        return self.returncode == 0 and not self.timed_out


@functools.lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """The command prefix that puts a process in a fresh network namespace, or () if none works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--net") if os.geteuid() == 0 else (unshare, "--map-root-user", "--net")
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else ()


def run_python(code: str, stdin: str = "", config: SandboxConfig | None = None) -> SandboxResult:
    """Run `code` as a script with `stdin` as its input, under the limits of `config`."""
    config = config or SandboxConfig()
    base = tempfile.mkdtemp(prefix="megarl-sandbox-")
    try:
        root = os.path.join(base, "root")
        os.mkdir(root)
        with open(os.path.join(root, "solution.py"), "w") as f:
            f.write(code)
        with open(os.path.join(base, "stdin"), "w") as f:
            f.write(stdin)
        return _run(base, root, config)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run(base: str, root: str, config: SandboxConfig) -> SandboxResult:
    prefix = network_namespace_prefix() if config.network_namespace else ()
    cmd = [*prefix, config.python, "-I", "-B", "-c", LAUNCHER, "solution.py"]
    paths = [os.path.join(base, name) for name in ("stdin", "stdout", "stderr")]
    start = time.monotonic()
    with open(paths[0], "rb") as fin, open(paths[1], "wb") as fout, open(paths[2], "wb") as ferr:
        proc = subprocess.Popen(
            cmd,
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            cwd=root,
            env=_env(root, config),
            start_new_session=True,
            close_fds=True,
        )
        timed_out = _wait_or_kill(proc, config.timeout_s)
    duration = time.monotonic() - start
    out, err = (_read(p, config.max_output_chars) for p in paths[1:])
    return SandboxResult(out, err, None if timed_out else proc.returncode, timed_out, duration)


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for `proc`; kill its whole process group on timeout (and on any interruption)."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _env(root: str, config: SandboxConfig) -> dict[str, str]:
    mib = 1024 * 1024
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": root,
        "TMPDIR": root,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "MEGARL_SANDBOX_ROOT": root,
        "MEGARL_SANDBOX_MEM": str(config.memory_mb * mib),
        "MEGARL_SANDBOX_FSIZE": str(config.max_file_mb * mib),
        "MEGARL_SANDBOX_CPU": str(int(config.timeout_s) + 1),
    }


def _read(path: str, max_chars: int) -> str:
    with open(path, "rb") as f:
        return f.read(max_chars * 4).decode("utf-8", errors="replace")[:max_chars]
