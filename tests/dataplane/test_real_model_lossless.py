"""The real target on 30 held-out prompts: speculation never changes a greedy token.

fixed and adaptive equal ar at concurrency 1, 8 and 32 (random drafter: every kind of
rejection; the committed starter drafter: real acceptances), and ar equals transformers
greedy decoding, except at float near-ties, which are named: the two best logits at the
first differing position are within 1e-3 of each other. The same exception applies
between modes: in float32 on CPU a row's matrix products can round differently when the
packed stream has another shape (the BLAS kernel changes with the number of rows), so a
token whose two best logits tie to 1e-5 may flip; every such case is printed.

With ``dataplane.batch_invariant`` on, a token's logits no longer depend on the shape of
the step, and fixed and adaptive equal ar exactly: no near-tie is tolerated.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaflash.config import DataplaneConfig
from dataplane.drafter import new_drafter
from dataplane.engine import Engine
from dataplane.node import STARTER_DIR
from dataplane.sequence import SamplingParams, Sequence
from promptsets import heldout_prompts

pytestmark = pytest.mark.realmodel
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompt_ids(real_tokenizer):
    rows = [r for d in ("chat", "code", "math") for r in heldout_prompts(d, 10)]
    tok = real_tokenizer
    return [tok.encode(tok.apply_chat([{"role": "user", "content": r["prompt"]}]))[:400] for r in rows]


def _run(target, mode, drafter, ids, concurrency, eos, batch_invariant=False):
    cfg = DataplaneConfig(mode=mode, max_running=concurrency, batch_invariant=batch_invariant)
    engine = Engine(target, cfg, drafter=drafter, drafter_version="v" if drafter else None, eos_token_ids=[eos],
                    max_model_len=1024)
    seqs = [Sequence(request_id=str(i), prompt_ids=p, params=SamplingParams(max_tokens=MAX_TOKENS))
            for i, p in enumerate(ids)]
    for s in seqs:
        engine.add(s)
    engine.run_until_idle()
    return [s.output_ids for s in seqs], seqs


@pytest.fixture(scope="module")
def ar_outputs(real_target, real_tokenizer, prompt_ids):
    return _run(real_target, "ar", None, prompt_ids, 32, real_tokenizer.eos_token_id)[0]


def _near_tie(target, prompt, tokens, j) -> float:
    """Gap between the two best logits of the target at output position j (ar's context)."""
    out = target.forward_packed(torch.tensor(prompt + tokens[:j]), [0, len(prompt) + j], [target.new_cache()])
    top2 = out.logits[-1].topk(2).values
    return float(top2[0] - top2[1])


def _drafters(target):
    out = [("random", new_drafter(target, seed=0))]
    if (STARTER_DIR / "manifest.json").is_file():
        from dataplane.drafter_io import load_bundle
        from dataplane.target_cache import target_identity

        out.append(("starter", load_bundle(STARTER_DIR, target)[0]))
        del target_identity
    return out


@pytest.mark.parametrize("concurrency", [32])
def test_speculative_modes_equal_ar(real_target, real_tokenizer, prompt_ids, ar_outputs, concurrency):
    """Default numerics: every difference is a float near-tie, and they are rare. The exact
    equality at 1, 8 and 32 is the batch-invariant test below."""
    for name, drafter in _drafters(real_target):
        for mode in ("fixed", "adaptive"):
            outs, seqs = _run(real_target, mode, drafter, prompt_ids, concurrency, real_tokenizer.eos_token_id)
            ties = []
            for i, (a, b) in enumerate(zip(outs, ar_outputs, strict=True)):
                if a != b:
                    j = next(k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
                    ties.append((i, j, _near_tie(real_target, prompt_ids[i], b, j)))
            assert all(gap < 1e-3 for _, _, gap in ties), f"{name}/{mode}/C={concurrency}: {ties}"
            assert len(ties) <= len(outs) // 10, f"{name}/{mode}/C={concurrency}: too many near-ties {ties}"
            if ties:
                print(f"near-ties {name}/{mode}/C={concurrency} (prompt, position, logit gap): {ties}")
            if mode == "fixed":
                assert sum(r.k_hat for s in seqs for r in s.rounds) > sum(len(s.rounds) for s in seqs)


@pytest.fixture(scope="module")
def ar_outputs_invariant(real_target, real_tokenizer, prompt_ids):
    return _run(real_target, "ar", None, prompt_ids, 32, real_tokenizer.eos_token_id, batch_invariant=True)[0]


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_speculative_modes_equal_ar_exactly_with_batch_invariant_numerics(real_target, real_tokenizer, prompt_ids,
                                                                          ar_outputs_invariant, concurrency):
    eos = real_tokenizer.eos_token_id
    # alone (C=1) every third prompt, ten across the three domains: each is served request by
    # request, the slowest way through the suite; in batches every prompt
    idx = list(range(0, len(prompt_ids), 3)) if concurrency == 1 else list(range(len(prompt_ids)))
    try:
        for name, drafter in _drafters(real_target):
            for mode in ("fixed", "adaptive"):
                outs, seqs = _run(real_target, mode, drafter, [prompt_ids[i] for i in idx], concurrency, eos,
                                  batch_invariant=True)
                ar = [ar_outputs_invariant[i] for i in idx]
                differ = [idx[j] for j, (a, b) in enumerate(zip(outs, ar, strict=True)) if a != b]
                assert differ == [], f"{name}/{mode}/C={concurrency}: prompts {differ} differ from ar"
                if mode == "fixed":
                    assert sum(r.k_hat for s in seqs for r in s.rounds) > sum(len(s.rounds) for s in seqs)
    finally:
        real_target.batch_invariant = False  # the session's target is shared with other tests


def test_ar_equals_transformers_greedy_except_named_near_ties(real_target_dir, real_tokenizer, prompt_ids,
                                                              ar_outputs):
    hf = AutoModelForCausalLM.from_pretrained(real_target_dir, dtype=torch.float32).eval()
    eos = real_tokenizer.eos_token_id
    near_ties = []
    with torch.no_grad():
        for i, (p, ours) in enumerate(zip(prompt_ids, ar_outputs, strict=True)):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=eos,
                              eos_token_id=eos)[0, len(p):].tolist()
            if ref == ours:
                continue
            j = next(k for k, (a, b) in enumerate(zip(ref, ours, strict=False)) if a != b)
            logits = hf(torch.tensor([p + ref[:j]])).logits[0, -1]
            top2 = logits.topk(2).values
            near_ties.append((i, j, float(top2[0] - top2[1])))
    assert all(gap < 1e-3 for _, _, gap in near_ties), near_ties
    print(f"near-ties (prompt, position, logit gap): {near_ties}")


@pytest.fixture(scope="module")
def real_target_bf16(real_target_dir):
    from dataplane.model import TargetModel
    from dataplane.precision import BF16_FLAGS, cpu_flags

    if not any(f in cpu_flags() for f in BF16_FLAGS):
        pytest.skip("no AVX512-BF16/AMX on this CPU: bfloat16 is emulated here and never served "
                    "(model.dtype auto serves float32); bfloat16 exactness is covered on tiny models")
    return TargetModel.from_pretrained(real_target_dir, dtype=torch.bfloat16)


def test_bfloat16_speculation_equals_ar_exactly_with_batch_invariant_numerics(real_target_bf16, real_tokenizer,
                                                                               prompt_ids):
    """The served precision on CPUs with AVX512-BF16: the same guarantee as in float32."""
    eos = real_tokenizer.eos_token_id
    ids = prompt_ids[::3]
    expected = _run(real_target_bf16, "ar", None, ids, 8, eos, batch_invariant=True)[0]
    for name, drafter in _drafters(real_target_bf16):
        for mode in ("fixed", "adaptive"):
            outs, seqs = _run(real_target_bf16, mode, drafter, ids, 8, eos, batch_invariant=True)
            differ = [i for i, (a, b) in enumerate(zip(outs, expected, strict=True)) if a != b]
            assert differ == [], f"bfloat16 {name}/{mode}: prompts {differ} differ from ar"
            if mode == "fixed":
                assert sum(r.k_hat for s in seqs for r in s.rounds) > sum(len(s.rounds) for s in seqs)
