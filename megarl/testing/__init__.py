"""Test helpers shared by megarl's test suites (multi-rank gloo runs on CPU: `megarl.testing.dist`; the
processes of a run by its tag: `processes`; two Ray nodes in network namespaces: `netns`).

Imports nothing heavy at package level; must not import Ray or vLLM.
"""
