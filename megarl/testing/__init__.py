"""Test helpers shared by megarl's test suites (multi-rank gloo runs on CPU: `megarl.testing.dist`).

Imports nothing heavy at package level; must not import Ray or vLLM.
"""
