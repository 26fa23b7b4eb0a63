"""Temperature 0: every speculative mode is token-identical to plain greedy decoding."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dataplane.drafter import new_drafter
from tests.dataplane.engine_util import make_engine, prompts, run
from tests.dataplane.oracle import OracleDrafter


@pytest.fixture(scope="module")
def ar_outputs(tiny_target):
    out = {}
    for c in (1, 8, 32):
        ps = prompts(c, 97, seed=c)
        out[c] = (ps, [s.output_ids for s in run(make_engine(tiny_target, "ar"), ps)])
    return out


def test_ar_equals_transformers_greedy(tiny_dir, tiny_target, ar_outputs):
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ps, outs = ar_outputs[8]
    for p, o in zip(ps, outs, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                          pad_token_id=2, eos_token_id=None)
        assert ref[0, len(p):].tolist() == o


@pytest.mark.parametrize("concurrency", [1, 8, 32])
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_random_drafter_is_lossless(tiny_target, ar_outputs, mode, concurrency):
    ps, expected = ar_outputs[concurrency]
    drafter = new_drafter(tiny_target, seed=7, num_layers=1, n_target_layers=2, block_size=8)
    seqs = run(make_engine(tiny_target, mode, drafter, breakeven=False), ps)
    assert [s.output_ids for s in seqs] == expected


@pytest.mark.parametrize("concurrency", [1, 8, 32])
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_oracle_drafter_is_lossless_and_accepts(tiny_target, ar_outputs, concurrency, error_rate):
    ps, expected = ar_outputs[concurrency]
    base = new_drafter(tiny_target, seed=1, num_layers=1, n_target_layers=2, block_size=8)
    oracle = OracleDrafter(base, tiny_target, error_rate=error_rate, a_hat=0.7)
    seqs = run(make_engine(tiny_target, "adaptive", oracle, breakeven=False), ps, oracle=oracle)
    assert [s.output_ids for s in seqs] == expected
    accepted = sum(r.accepted for s in seqs for r in s.rounds)
    rounds = sum(len(s.rounds) for s in seqs)
    assert accepted > rounds  # speculation really happened: more than one draft per round on average
    if error_rate == 0.0:
        # k_hat = floor(0.7 * 8) = 5: every draft of every full round is accepted.
        assert all(r.accepted == r.k_hat - 1 for s in seqs for r in s.rounds)


def test_the_last_update_finds_the_request_finished(tiny_target):
    """The HTTP side reads ``seq.finish_reason`` the moment the engine's last update arrives
    (on the event loop, while the engine thread goes on): the engine must have finished the
    sequence before it tells. Told first, a reader in between saw no finish reason and
    waited for an update that never came: the request hung with its answer done."""
    from dataplane.envelope import RequestEnvelope
    from dataplane.sequence import SamplingParams, Sequence, Status
    from tests.dataplane.engine_util import make_engine, prompts

    seen = []
    eng = make_engine(tiny_target, mode="ar")
    for i, (p, limit) in enumerate(zip(prompts(6, 97, seed=5), (1, 2, 5, 9, 13, 17), strict=True)):
        s = Sequence(request_id=f"r{i}", prompt_ids=p, params=SamplingParams(max_tokens=limit, ignore_eos=True))
        env = RequestEnvelope(prompt_text="", domain=None,
                              on_update=lambda q, _new, done: done and seen.append((q.status, q.finish_reason)))
        eng.add(s, env)
    eng.run_until_idle()
    assert seen == [(Status.FINISHED, "length")] * 6
