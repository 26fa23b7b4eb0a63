"""Helpers to drive the engine synchronously in tests."""

from __future__ import annotations

import torch

from adaflash.config import DataplaneConfig
from dataplane.engine import Engine
from dataplane.sequence import SamplingParams, Sequence


def make_engine(target, mode="adaptive", drafter=None, version="v1", **over) -> Engine:
    cfg = DataplaneConfig(mode=mode, **{"block_size": 8, **over})
    return Engine(target, cfg, drafter=drafter, drafter_version=version if drafter else None, max_model_len=256)


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


def run(engine: Engine, prompt_ids: list[list[int]], max_tokens: int = 24, oracle=None, **params) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(prompt_ids):
        s = Sequence(request_id=f"r{i}", prompt_ids=list(p),
                     params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))
        seqs.append(s)
        engine.add(s)
    if oracle is not None:
        _wire_oracle(engine, oracle, seqs)
    engine.run_until_idle()
    return seqs


def _wire_oracle(engine, oracle, seqs):
    """Let the oracle see each sequence's committed tokens through its drafter cache."""
    orig = engine._prefill

    def prefill(batch):
        orig(batch)
        for s in batch:
            if s.drafter_kv is not None:
                oracle.track(s.drafter_kv, _tokens_of(s))

    engine._prefill = prefill


def _tokens_of(s):
    return lambda: s.prompt_ids + s.output_ids
