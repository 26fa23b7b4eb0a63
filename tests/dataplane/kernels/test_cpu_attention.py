"""The C few-query attention over a float32 cache (dataplane/kernels/attention_f32.c)
against its torch reference, and the serving forward that uses it against the model's
reference path."""

from __future__ import annotations

import pytest
import torch

from dataplane.kernels import cpu_attention as ca
from dataplane.precision import cpu_flags

HAS_AVX2 = "avx2" in cpu_flags()
# The kernel is compiled with -mavx2 -mfma; on a CPU without AVX2 it never runs (``takes`` and
# ``takes_batch`` say no and the torch reference serves: test_available_wherever_the_cpu_has_avx2 and
# test_not_causal_sees_every_new_key run there), so there is nothing of it to test there. Every machine
# here has AVX2, so these tests run in CI.
needs_avx2 = pytest.mark.skipif(not HAS_AVX2, reason="the kernel is built for AVX2 CPUs; elsewhere the reference serves")


def _case(n, start, heads, kvh, d, dtype, seed, cap=None):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, heads, d, generator=g) * 2).to(dtype)
    qkv = torch.randn(n, heads + 2 * kvh, d, generator=g).to(dtype)  # k and v strided, as in a fused qkv
    k, v = qkv[:, heads : heads + kvh], qkv[:, heads + kvh :]
    cache = torch.randn(2, kvh, cap or start + n + 5, d, generator=g)
    return q, k, v, cache


def test_available_wherever_the_cpu_has_avx2():
    assert ca.available() == HAS_AVX2


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "start"), [(1, 0), (1, 128), (2, 9), (16, 128), (17, 3), (64, 300)])
@pytest.mark.parametrize(("heads", "kvh", "d"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 16), (4, 2, 24)])
def test_equals_the_reference(dtype, n, start, heads, kvh, d):
    q, k, v, cache = _case(n, start, heads, kvh, d, dtype, seed=n * 1000 + start + d)
    c_ref, c_ours = cache.clone(), cache.clone()
    want = ca.attend_cached_torch(q, k, v, c_ref, start)
    assert ca.takes(q, k, v, c_ours)
    got = ca.attend_cached(q, k, v, c_ours, start)
    assert got.dtype == dtype and got.shape == (n, heads * d)
    assert torch.equal(c_ref, c_ours)  # the new keys and values stored exactly, nothing else touched
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    else:  # the same float32 value rounded once: at most one bfloat16 step apart, rarely
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=8e-3)
        assert (got != want).float().mean() < 2e-2


@needs_avx2
@pytest.mark.parametrize("sharpness", [8.0, 60.0])
def test_a_peaked_softmax_equals_the_reference(sharpness):
    """Scores far apart: most shifted scores fall below exp's underflow (-87.3) in the vector
    lanes and in the scalar tail alike (37 keys: four blocks of eight and five more)."""
    q, k, v, cache = _case(3, 34, 9, 3, 64, torch.float32, seed=11)
    q = q * sharpness
    want = ca.attend_cached_torch(q, k, v, cache.clone(), 34)
    got = ca.attend_cached(q, k, v, cache.clone(), 34)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)


@needs_avx2
def test_a_tokens_row_does_not_depend_on_how_many_came_with_it():
    """Decode one token, or verify it with fifteen more: its row is bitwise the same."""
    q, k, v, cache = _case(16, 40, 9, 3, 64, torch.bfloat16, seed=7)
    one = ca.attend_cached(q[:1], k[:1], v[:1], cache.clone(), 40)
    many = ca.attend_cached(q, k, v, cache.clone(), 40)
    assert torch.equal(one[0], many[0])


def test_not_causal_sees_every_new_key():
    q, k, v, cache = _case(4, 10, 4, 2, 16, torch.float32, seed=3)
    want = ca.attend_cached_torch(q, k, v, cache.clone(), 10, causal=False)
    got = ca.attend_cached(q, k, v, cache.clone(), 10, causal=False) if HAS_AVX2 else want
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    causal = ca.attend_cached_torch(q, k, v, cache.clone(), 10, causal=True)
    assert not torch.allclose(causal[0], want[0])  # the first query sees three keys fewer when causal


def test_shapes_it_does_not_take():
    q, k, v, cache = _case(2, 4, 9, 3, 64, torch.float32, seed=1)
    assert not ca.takes(q, k, v, cache.double())  # a cache that is not float32
    assert not ca.takes(q.half(), k.half(), v.half(), cache)  # float16 queries
    q65, k65, v65, c65 = _case(65, 0, 9, 3, 64, torch.float32, seed=2)
    assert not ca.takes(q65, k65, v65, c65)  # more new tokens than a verify brings
    q6, k6, v6, c6 = _case(2, 4, 4, 2, 6, torch.float32, seed=2)
    assert not ca.takes(q6, k6, v6, c6)  # a head size the vector loop does not take


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_serving_forward_matches_the_reference_forward(tiny_dir, dtype, monkeypatch):
    """A lone request's prompt, decode and verify through the fused forward (the kernel) and
    through the module-by-module reference (PyTorch's attention) give the same logits."""
    from dataplane.runner import ModelRunner

    fused = ModelRunner.reference(dtype).load_target(tiny_dir)
    ref = ModelRunner.reference(dtype).load_target(tiny_dir)
    ref.reference = True
    fused.fused().stack = None  # the Python layers (the float32 C forward has its own tests)
    calls = []
    kernel = ca.attend_cached
    monkeypatch.setattr(ca, "attend_cached", lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 90, (23,), generator=g)
    kv_f, kv_r = fused.new_cache(64), ref.new_cache(64)
    for ids in (prompt, torch.randint(3, 90, (1,), generator=g), torch.randint(3, 90, (9,), generator=g)):
        a = fused.forward_packed(ids, [0, len(ids)], [kv_f]).logits
        b = ref.forward_packed(ids, [0, len(ids)], [kv_r]).logits
        tol = 1e-4 if dtype == torch.float32 else 6e-2
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    layers = fused.args.num_layers
    assert calls == [23] * layers + [1] * layers + [9] * layers  # every layer of every step in the kernel


def _stream(bounds, heads, kvh, d, dtype, seed, layers=3):
    g = torch.Generator().manual_seed(seed)
    T = bounds[-1][1]
    q = (torch.randn(T, heads, d, generator=g) * 2).to(dtype)
    qkv = torch.randn(T, heads + 2 * kvh, d, generator=g).to(dtype)
    k, v = qkv[:, heads : heads + kvh], qkv[:, heads + kvh :]
    # SeqKV.data of each request: [layers, 2, kv_heads, cap, d], capacities differ
    data = [torch.randn(layers, 2, kvh, st + (e - s) + 3 * b, d, generator=g) for b, (s, e, st) in enumerate(bounds)]
    return q, k, v, data


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bounds", [
    [(0, 1, 40), (1, 2, 7), (2, 3, 130), (3, 4, 0)],  # a decode step of four requests
    [(0, 16, 128), (16, 20, 3), (20, 21, 60), (21, 37, 0)],  # verify blocks of mixed lengths
    [(0, 64, 300), (64, 65, 1)],
])
@pytest.mark.parametrize(("heads", "kvh", "d"), [(9, 3, 64), (8, 2, 128), (6, 1, 16)])
def test_a_packed_stream_equals_the_reference_and_each_request_alone(dtype, bounds, heads, kvh, d):
    """One call for the whole stream: within the reference's tolerance, bitwise what each
    request's lone call gives (a request's rows do not depend on its batch), every request's
    new keys and values stored in its own cache at the layer asked, nothing else touched."""
    q, k, v, data = _stream(bounds, heads, kvh, d, dtype, seed=len(bounds) * 100 + d)
    layer = 1
    ref_data, alone_data = [t.clone() for t in data], [t.clone() for t in data]
    want = ca.attend_batch_torch(q, k, v, [t[layer] for t in ref_data], bounds)
    assert ca.takes_batch(q, k, v, data, bounds)
    got = ca.attend_batch(q, k, v, ca.BatchArgs(data, bounds), layer)
    alone = torch.cat([ca.attend_cached(q[s:e], k[s:e], v[s:e], t[layer], st)
                       for t, (s, e, st) in zip(alone_data, bounds, strict=True)])
    assert got.dtype == dtype and got.shape == (q.shape[0], heads * d)
    assert torch.equal(got, alone)
    assert all(torch.equal(a, b) for a, b in zip(data, ref_data, strict=True))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=8e-3)


def test_streams_the_batched_kernel_does_not_take():
    bounds = [(0, 1, 4), (1, 66, 0)]  # a prompt of 65 tokens beside a decode
    q, k, v, data = _stream(bounds, 9, 3, 64, torch.float32, seed=5)
    assert not ca.takes_batch(q, k, v, data, bounds)
    short = [(0, 1, 4), (1, 2, 0)]
    q, k, v, data = _stream(short, 9, 3, 64, torch.float32, seed=6)
    assert ca.takes_batch(q, k, v, data, short) == HAS_AVX2
    assert not ca.takes_batch(q, k, v, [data[0], data[1].double()], short)  # a cache that is not float32
    assert not ca.takes_batch(q, k, v, [data[0], data[1].transpose(3, 4).contiguous().transpose(3, 4)],
                              short)  # not contiguous


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_through_the_serving_forward_matches_the_reference_forward(tiny_dir, dtype, monkeypatch):
    """Three requests decoded and verified together through the fused forward (one batched
    kernel call a layer) give the reference forward's logits."""
    from dataplane.runner import ModelRunner

    fused = ModelRunner.reference(dtype).load_target(tiny_dir)
    ref = ModelRunner.reference(dtype).load_target(tiny_dir)
    ref.reference = True
    fused.fused().stack = None  # the Python layers (the float32 C forward has its own tests)
    calls = []
    kernel = ca.attend_batch
    monkeypatch.setattr(ca, "attend_batch", lambda *a, **kw: calls.append(a[3].B) or kernel(*a, **kw))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (n,), generator=g) for n in (11, 30, 5)]
    caches = {name: [m.new_cache(96) for _ in prompts] for name, m in (("f", fused), ("r", ref))}
    for b, p in enumerate(prompts):  # prompts one at a time, as the engine prefills
        for name, m in (("f", fused), ("r", ref)):
            m.forward_packed(p, [0, len(p)], [caches[name][b]])
    for lengths in ((1, 1, 1), (4, 16, 1), (1, 9, 3)):
        ids = [torch.randint(3, 90, (n,), generator=g) for n in lengths]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        stream = torch.cat(ids)
        a = fused.forward_packed(stream, cu, caches["f"]).logits
        b = ref.forward_packed(stream, cu, caches["r"]).logits
        tol = 1e-4 if dtype == torch.float32 else 6e-2
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    assert calls == [3] * (3 * fused.args.num_layers)
