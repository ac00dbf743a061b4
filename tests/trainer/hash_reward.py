"""A reward that varies within a prompt's group even for an untrained policy: 1 for a third of the
response texts (by CRC32), else 0. About a fifth of 4-sample groups get equal rewards, which DAPO
dynamic sampling must drop. Loaded by path (reward.reward_fn)."""

import zlib


def reward(solution_str, ground_truth, extra):
    return float(zlib.crc32(solution_str.encode()) % 3 == 0)
