"""Packed batches the planner tests share (a helper module, like spawn_gloo.py: no tests here)."""

from __future__ import annotations

import numpy as np


def long_tail_docs(seed: int, total: int) -> list[int]:
    """Document lengths summing to ``total``, log-uniform from 64 tokens to half the batch (a few long
    documents among short ones, as in long-context training mixes)."""
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(np.exp(rng.uniform(np.log(64), np.log(total / 2)))))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


def short_docs(seed: int, total: int) -> list[int]:
    """Log-normal document lengths (median ~550 tokens, a few over 10K) summing to ``total``: many
    short documents, as in Wikipedia batches, which FCP packs whole onto ranks."""
    rng = np.random.default_rng(seed)
    out, used = [], 0
    while used < total:
        n = int(min(max(1, rng.lognormal(6.3, 1.3)), total - used))
        out.append(n)
        used += n
    return out


def shared_question_answers(seed: int, total: int) -> tuple[int, list[int]]:
    """(question length, answer lengths) of a shared-question batch of ``total`` tokens: a question of
    256-2047 tokens and 4-39 answers cut at random points of the rest."""
    rng = np.random.default_rng(seed)
    question = int(rng.integers(256, 2048))
    rest = total - question
    n = int(rng.integers(4, 40))
    cuts = np.sort(rng.choice(np.arange(1, rest), n - 1, replace=False))
    return question, np.diff(np.r_[0, cuts, rest]).tolist()
