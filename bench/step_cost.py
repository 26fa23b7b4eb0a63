"""How a target forward's time grows with the tokens it verifies.

Speculation pays when verifying k tokens costs little more than decoding one. The curve
is measured at concurrency 1 and 16: every request holds ``context`` cached tokens and
brings n new tokens; the forward's time is reported relative to n = 1 at the same
concurrency. Repeats go round all points in turn, so that a slow spell of a shared
machine hits every point alike, and each point keeps its fastest repeat.
"""

from __future__ import annotations

import statistics
import time

import torch


def _setup(target, requests: int, n: int, context: int, g: torch.Generator):
    kvs = []
    for _ in range(requests):
        kv = target.new_cache(context + n + 1)
        target.forward_packed(torch.randint(3, 1000, (context,), generator=g), [0, context], [kv],
                              logits_index=torch.empty(0, dtype=torch.int64))
        kvs.append(kv)
    return kvs, torch.randint(3, 1000, (n * requests,), generator=g), [i * n for i in range(requests + 1)]


@torch.inference_mode()
def drafter_pass_s(target, drafter, prompt_ids: list[int], repeats: int = 7) -> float:
    """Median seconds of one drafter pass (block, length head, draft logits) for one request
    whose context is ``prompt_ids`` (the first pass is a warm-up and not counted)."""
    ids = torch.tensor(prompt_ids, dtype=torch.int64)
    hid = target.forward_packed(ids, [0, len(prompt_ids)], [target.new_cache(len(prompt_ids))],
                                logits_index=torch.empty(0, dtype=torch.int64),
                                hidden_layers=tuple(drafter.config.target_layers)).hidden
    kv = drafter.new_cache(len(prompt_ids) + drafter.config.block_size)
    drafter.extend_context(hid, [0, len(prompt_ids)], [kv])
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = drafter.forward_block(ids[-1:], [kv])
        drafter.length_head(h)
        drafter.logits(h[:, 1:])
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def _time_points(target, setups: dict, context: int, repeats: int) -> dict:
    times: dict = {key: [] for key in setups}
    for _ in range(repeats):
        for key, (kvs, stream, cu) in setups.items():
            for kv in kvs:
                kv.truncate(context)
            t0 = time.perf_counter()
            target.forward_packed(stream, cu, kvs)  # logits at every row, as a verify step
            times[key].append(time.perf_counter() - t0)
    return {key: min(ts) for key, ts in times.items()}


def verify_cost_curve(target, concurrency=(1, 16), lengths=(1, 2, 4, 8, 16), context: int = 128,
                      repeats: int = 5) -> list[dict]:
    """Rows {concurrency, tokens_per_request, ms, ratio_to_one_token}."""
    g = torch.Generator().manual_seed(0)
    setups = {(c, n): _setup(target, c, n, context, g) for c in concurrency for n in lengths}
    best = _time_points(target, setups, context, repeats)
    return [{"concurrency": c, "tokens_per_request": n, "ms": round(1e3 * best[(c, n)], 3),
             "ratio_to_one_token": round(best[(c, n)] / best[(c, lengths[0])], 4)}
            for c in concurrency for n in lengths]


def packed_verify_cost(target, n_tokens: int = 64, context: int = 128, splits=(1, 4, 8, 16),
                       repeats: int = 3) -> list[dict]:
    """One verify forward of ``n_tokens`` spread over B requests, relative to B = 1."""
    g = torch.Generator().manual_seed(0)
    setups = {b: _setup(target, b, n_tokens // b, context, g) for b in splits}
    best = _time_points(target, setups, context, repeats)
    return [{"requests": b, "tokens": (n_tokens // b) * b, "seconds": best[b],
             "ratio_to_one_sequence": best[b] / best[splits[0]]} for b in splits]


def forward_paths(target_dir, native_bf16: bool, context: int = 128, repeats: int = 7) -> list[dict]:
    """One request's decode (1 token) and verify (16 tokens) forward at C=1, per path.

    The module-by-module float32 forward is the path nodes served before the precision was
    chosen and the forward fused; the fused float32 path is what a CPU without native
    bfloat16 serves now; the fused bfloat16 path is served where the CPU multiplies it
    natively. Repeats go round the paths in turn; each keeps its fastest.
    """
    from dataplane.runner import ModelRunner

    variants = [("float32", True), ("float32", False)] + ([("bfloat16", False)] if native_bf16 else [])
    g = torch.Generator().manual_seed(0)
    setups = {}
    for dtype, reference in variants:
        m = ModelRunner.reference(dtype).load_target(target_dir)
        m.reference = reference
        for n in (1, 16):
            setups[(dtype, reference, n)] = (m, *_setup(m, 1, n, context, g))
    times: dict = {key: [] for key in setups}
    for _ in range(repeats):
        for key, (m, kvs, stream, cu) in setups.items():
            kvs[0].truncate(context)
            t0 = time.perf_counter()
            m.forward_packed(stream, cu, kvs)
            times[key].append(time.perf_counter() - t0)
    base = min(times[("float32", True, 1)])
    return [{"precision": dtype, "path": "module reference" if reference else "fused", "tokens": n,
             "ms": round(1e3 * min(times[(dtype, reference, n)]), 3),
             "speedup_vs_float32_reference_decode": round(base / min(times[(dtype, reference, n)]), 3)}
            for dtype, reference, n in setups]
