"""Data: the batch type that crosses between roles, row balancing across ranks, prompt datasets,
tokenizers and tasks.

Import-light on purpose: importing `megarl.data` loads nothing; import the submodule you need
(`megarl.data.batch`, `megarl.data.balancing`, ...). Nothing here imports megatron, vLLM or Ray.
"""
