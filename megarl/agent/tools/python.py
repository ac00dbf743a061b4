"""The `python` tool: a code interpreter in megarl's sandbox (no network, time and memory limits).

Owns `PythonTool`: each call runs the code as a fresh script through `megarl.rewards.sandbox.run_python`
(its own process group, killed at `timeout_s`; RLIMIT_AS memory; a fresh network namespace where the
machine allows it) and returns stdout, then stderr (a traceback with only the script's own frames) and the exit
status when the run failed.
Imports only the sandbox (standard library).
"""

from __future__ import annotations

from megarl.agent.tools.base import TOOLS, Tool
from megarl.rewards.sandbox import SandboxConfig, run_python


@TOOLS.register("python", "code_interpreter")
class PythonTool(Tool):
    """Run Python code and return what it printed."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python script and return its printed output. State is not kept between calls.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }

    def __init__(self, schema=None, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 8192):
        super().__init__(schema)
        self.sandbox = SandboxConfig(timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)

    def execute(self, state, arguments: dict) -> str:
        result = run_python(str(arguments["code"]), config=self.sandbox)
        if result.timed_out:
            return f"{result.stdout}\nError: the code ran past {self.sandbox.timeout_s} s and was killed".lstrip()
        if not result.ok:
            return f"{result.stdout}{clean_traceback(result.stderr)}\n(exit status {result.returncode})".lstrip()
        return result.stdout


def clean_traceback(stderr: str) -> str:
    """stderr with a traceback's frames outside the script (the sandbox launcher, the standard library)
    folded into "  ...", so the error line survives truncation."""
    out, skipping = [], False
    for line in stderr.splitlines():
        if line.startswith("  File "):
            skipping = not line.startswith('  File "solution.py"')
            if skipping and out[-1:] != ["  ..."]:
                out.append("  ...")
        elif not line.startswith("    "):
            skipping = False
        if not skipping and line != "  ...":
            out.append(line)
    return "\n".join(out) + ("\n" if stderr.endswith("\n") else "")
