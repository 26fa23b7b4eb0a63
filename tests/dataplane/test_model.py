"""Our model runner against transformers, and the packed variable-length forward."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dataplane.model import TargetModel, default_hidden_layers


def _hf(directory):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_qwen_dir"])
def test_logits_and_hidden_match_transformers(fixture, request):
    d = request.getfixturevalue(fixture)
    ours, ref = TargetModel.from_pretrained(d), _hf(d)
    ids = torch.randint(3, 97, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_out = ref(ids[None], output_hidden_states=True)
    out = ours.forward_packed(ids, [0, 23], [ours.new_cache()], hidden_layers=(0, 2))
    assert (out.logits - hf_out.logits[0]).abs().max() < 1e-4
    # hidden_states[0] is the embedding output, so decoder layer L is index L + 1.
    assert (out.hidden[:, 0] - hf_out.hidden_states[1][0]).abs().max() < 1e-4
    assert (out.hidden[:, 1] - hf_out.hidden_states[3][0]).abs().max() < 1e-4


def test_packed_stream_with_cached_prefixes_matches_separate_runs(tiny_target):
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 97, (n,), generator=g) for n in (5, 17, 1, 30)]
    split = [2, 10, 0, 29]  # prefix already cached, the rest arrives packed
    full = []
    for s in seqs:
        full.append(tiny_target.forward_packed(s, [0, len(s)], [tiny_target.new_cache()]).logits)
    kvs = [tiny_target.new_cache(capacity=4) for _ in seqs]  # small capacity: exercises growth
    for s, p, kv in zip(seqs, split, kvs, strict=True):
        if p:
            tiny_target.forward_packed(s[:p], [0, p], [kv])
    stream = torch.cat([s[p:] for s, p in zip(seqs, split, strict=True)])
    cu = [0]
    for s, p in zip(seqs, split, strict=True):
        cu.append(cu[-1] + len(s) - p)
    out = tiny_target.forward_packed(stream, cu, kvs)
    for b, (s, p) in enumerate(zip(seqs, split, strict=True)):
        assert torch.allclose(out.logits[cu[b] : cu[b + 1]], full[b][p:], atol=1e-5)
        assert kvs[b].length == len(s)


def test_logits_index_and_truncate(tiny_target):
    ids = torch.randint(3, 97, (12,), generator=torch.Generator().manual_seed(3))
    kv = tiny_target.new_cache()
    out = tiny_target.forward_packed(ids, [0, 12], [kv], logits_index=torch.tensor([11]))
    assert out.logits.shape == (1, 97)
    kv.truncate(8)  # drop 4 positions, then continue: same as having run only 8 + the next 4
    again = tiny_target.forward_packed(ids[8:], [0, 4], [kv]).logits
    ref = tiny_target.forward_packed(ids, [0, 12], [tiny_target.new_cache()]).logits[8:]
    assert torch.allclose(again, ref, atol=1e-5)
    with pytest.raises(ValueError):
        kv.truncate(100)


def test_default_hidden_layers_are_evenly_spaced():
    assert default_hidden_layers(30, 4) == (1, 10, 18, 27)
    assert default_hidden_layers(36, 5)[0] == 1 and default_hidden_layers(36, 5)[-1] == 33
    assert default_hidden_layers(4, 2) == (0, 3)


@pytest.mark.realmodel
def test_real_model_logits_match_transformers(real_target_dir, real_target, real_tokenizer):
    ref = _hf(real_target_dir)
    text = real_tokenizer.apply_chat([{"role": "user", "content": "Name three prime numbers."}])
    ids = torch.tensor(real_tokenizer.encode(text))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    kv = real_target.new_cache()
    out = real_target.forward_packed(ids[:-5], [0, len(ids) - 5], [kv])
    rest = real_target.forward_packed(ids[-5:], [0, 5], [kv])
    # float32 products summed in another order than MKL's (the AVX2 kernel of cpu_gemv_f32):
    # 30 layers of it move logits of magnitude ~20 by about 1e-4 (MKL itself: 8e-5)
    assert (out.logits - expected[:-5]).abs().max() < 2e-4
    assert (rest.logits - expected[-5:]).abs().max() < 2e-4


@pytest.mark.parametrize("budget", [65536, 40])
def test_grouped_stream_attention_matches_separate_runs(tiny_target, monkeypatch, budget):
    """70 requests (more than one group holds), a prompt longer than SMALL_QUERIES that
    attends alone, and with budget 40 groups cut by the padded-position budget."""
    from dataplane import packed_attention
    from dataplane.attention import SMALL_QUERIES

    monkeypatch.setattr(packed_attention, "GROUP_POSITIONS", budget)
    g = torch.Generator().manual_seed(5)
    lens = [int(x) for x in torch.randint(2, 24, (70,), generator=g)] + [SMALL_QUERIES + 9]
    seqs = [torch.randint(3, 97, (n,), generator=g) for n in lens]
    split = [int(torch.randint(0, n, (1,), generator=g)) for n in lens[:-1]] + [0]
    kvs = [tiny_target.new_cache(capacity=8) for _ in seqs]
    for s, p, kv in zip(seqs, split, kvs, strict=True):
        if p:
            tiny_target.forward_packed(s[:p], [0, p], [kv])
    plan = packed_attention.StreamPlan([(0, len(s) - p, p) for s, p in zip(seqs, split, strict=True)],
                                       4, 2, 8, torch.float32, torch.device("cpu"))
    assert len(plan.groups) >= 2 and any(e - s > SMALL_QUERIES for _, s, e, _ in plan.singles)
    stream = torch.cat([s[p:] for s, p in zip(seqs, split, strict=True)])
    cu = [0]
    for s, p in zip(seqs, split, strict=True):
        cu.append(cu[-1] + len(s) - p)
    out = tiny_target.forward_packed(stream, cu, kvs, hidden_layers=(1,))
    for b, (s, p) in enumerate(zip(seqs, split, strict=True)):
        ref = tiny_target.forward_packed(s, [0, len(s)], [tiny_target.new_cache()], hidden_layers=(1,))
        assert torch.allclose(out.logits[cu[b] : cu[b + 1]], ref.logits[p:], atol=1e-5)
        assert torch.allclose(out.hidden[cu[b] : cu[b + 1]], ref.hidden[p:], atol=1e-5)
        assert kvs[b].length == len(s)


@pytest.mark.parametrize("new", [1, 2, 16])
def test_lone_request_continuing_its_cache_matches_one_run(tiny_target, new):
    """A verify at C=1: one request brings ``new`` tokens after a cached prefix; its mask is
    built once per forward (StreamPlan.single_masks) and must equal running the whole text."""
    from dataplane import packed_attention

    g = torch.Generator().manual_seed(new)
    text = torch.randint(3, 97, (21 + new,), generator=g)
    kv = tiny_target.new_cache(capacity=8)  # grows past its capacity: attention reads strided views
    tiny_target.forward_packed(text[:21], [0, 21], [kv])
    plan = packed_attention.StreamPlan([(0, new, 21)], 4, 2, 8, torch.float32, torch.device("cpu"))
    assert [b for b, *_ in plan.singles] == [0] and (0 in plan.single_masks) == (new > 1)
    out = tiny_target.forward_packed(text[21:], [0, new], [kv], hidden_layers=(1,))
    ref = tiny_target.forward_packed(text, [0, len(text)], [tiny_target.new_cache()], hidden_layers=(1,))
    torch.testing.assert_close(out.logits, ref.logits[21:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.hidden, ref.hidden[21:], atol=1e-5, rtol=1e-5)


def test_warm_up_builds_the_serving_forward_and_changes_nothing(tiny_dir):
    """A node warms its target up before it is ready: the fused weights are laid out then,
    and what the model computes afterwards is what a model never warmed up computes."""
    warm, cold = TargetModel.from_pretrained(tiny_dir), TargetModel.from_pretrained(tiny_dir)
    assert warm._fused is None
    assert warm.warm_up() > 0
    assert warm._fused is not None
    ids = torch.tensor([5, 9, 2, 7, 3])
    kw, kc = warm.new_cache(16), cold.new_cache(16)
    assert torch.equal(warm.forward_packed(ids, [0, 5], [kw]).logits, cold.forward_packed(ids, [0, 5], [kc]).logits)
    assert kw.length == kc.length == 5


def test_warm_up_times_the_weight_products_for_the_cost_model(tiny_dir):
    """The warm-up also times the weight products per row count; an engine on that target
    prices extra verify rows at no less than them (``CostModel.set_products``)."""
    from adaflash.config import DataplaneConfig
    from dataplane.engine import Engine

    m = TargetModel.from_pretrained(tiny_dir)
    assert m.product_curve == []
    m.warm_up()
    rows = [r for r, _ in m.product_curve]
    assert rows == sorted(rows) and rows[0] == 1 and rows[-1] >= 64
    assert all(s > 0 for _, s in m.product_curve)
    eng = Engine(m, DataplaneConfig(mode="ar"))
    assert [r for r, _ in eng.cost.products] == rows
    assert eng.cost.snapshot().products and eng.cost.products_time(rows[-1]) >= eng.cost.products_time(1)
