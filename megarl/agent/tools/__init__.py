"""Tools an agent loop can call: the contract, the registry, YAML loading and the built-in tools.

Modules: `base` (`Tool`, `ToolResult`, `TOOLS`, `ToolSet`, `ToolSession`), `runner` (running one
turn's calls concurrently under limits; every failure becomes an error observation),
`calculator`, `python` (the sandboxed interpreter), `search` (BM25 over a local corpus).
A tool YAML (`AgentConfig.tool_config`):

    tools:
      - type: calculator                    # a registered tool, or pkg.module:Class / file.py:Class
      - type: search
        config: {corpus: data/wiki.jsonl}   # constructor keyword arguments
        schema:                             # optional: the OpenAI function schema the model sees
          type: function
          function: {name: search, description: ..., parameters: {type: object, properties: {...}}}

Imports no torch, vLLM or Ray (bm25s only when a search tool is built).
"""

from megarl.agent.tools import calculator, python, search  # noqa: F401 - register the built-in tools
from megarl.agent.tools.base import TOOLS, Tool, ToolResult, ToolSession, ToolSet

__all__ = ["TOOLS", "Tool", "ToolResult", "ToolSession", "ToolSet"]
