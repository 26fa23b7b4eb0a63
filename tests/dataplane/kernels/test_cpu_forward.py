"""The float32 layers in one C call (dataplane/kernels/forward_f32.c) against their torch
reference: hidden states, the keys and values stored, the hidden layers handed out, each
request's rows independent of the rest of the stream, and where the target's forward
takes it (float32 on an AVX2 CPU where the GEMV kernel pays) and where it does not."""

from __future__ import annotations

import pytest
import torch

from dataplane.kernels import cpu_forward, cpu_gemv_f32
from dataplane.kernels.cpu_forward import LayerStack, LayerWeights, layers_torch
from dataplane.model import TargetModel
from dataplane.precision import cpu_flags
from tests.tiny_models import save_tiny

HAS_AVX2 = {"avx2", "fma"} <= set(cpu_flags())


def _stack(seed: int, H=64, heads=6, kvh=2, d=16, inter=96, L=3):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.1):
        return torch.randn(*shape, generator=g) * s

    layers = [LayerWeights(1 + r(H), r((heads + 2 * kvh) * d, H), r(H, heads * d), 1 + r(H), r(2 * inter, H),
                           r(H, inter)) for _ in range(L)]
    return layers, LayerStack(layers, heads, kvh, 1e-5), g


def _rope(pos: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = pos.unsqueeze(1).float() * (10000.0 ** (-torch.arange(0, d, 2).float() / d)).repeat(2).unsqueeze(0)
    return ang.cos(), ang.sin()


def test_available_exactly_where_the_cpu_has_avx2_and_fma():
    assert cpu_forward.available() == HAS_AVX2


@pytest.mark.parametrize("bounds", [
    [(0, 1, 40)],  # a decode
    [(0, 16, 40)],  # a verify of sixteen
    [(0, 1, 3), (1, 5, 17), (5, 12, 0), (12, 13, 9)],  # decodes, verifies and a short prompt
    [(0, 64, 10), (64, 128, 0), (128, 150, 5)],  # more rows than one product call takes
    [(0, 90, 0)],  # a prompt
])
def test_equals_the_reference(bounds):
    if not cpu_forward.available():
        assert not HAS_AVX2
        return
    layers, stack, g = _stack(len(bounds))
    T = bounds[-1][1]
    x = torch.randn(T, 64, generator=g)
    x_before = x.clone()
    pos = torch.cat([torch.arange(st, st + e - s) for s, e, st in bounds])
    cos, sin = _rope(pos, 16)
    base = [torch.randn(3, 2, 2, 96, 16, generator=g) for _ in bounds]
    c_ref, c_ours = [c.clone() for c in base], [c.clone() for c in base]
    want_x, want_h = layers_torch(x, layers, 6, 2, 1e-5, cos, sin, c_ref, bounds, (0, 2, 0))
    assert stack.takes(x, bounds, c_ours)
    got_x, got_h = stack.run(x, cos, sin, c_ours, bounds, (0, 2, 0))
    torch.testing.assert_close(got_x, want_x, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_h, want_h, atol=2e-5, rtol=2e-5)
    for a, b in zip(c_ours, c_ref, strict=True):  # the new keys and values stored where the reference stores them
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert torch.equal(x, x_before)  # the input is left as it was: the output is new


def test_a_requests_rows_do_not_depend_on_the_stream():
    """A decode of one token, the same token verified with fifteen more, and the same rows
    beside other requests: bit for bit alike."""
    if not cpu_forward.available():
        return
    layers, stack, g = _stack(7)
    x = torch.randn(16, 64, generator=g)
    cos, sin = _rope(torch.arange(30, 46), 16)
    cache = torch.randn(3, 2, 2, 64, 16, generator=g)
    verify, _ = stack.run(x, cos, sin, [cache.clone()], [(0, 16, 30)])
    decode, _ = stack.run(x[:1], cos[:1], sin[:1], [cache.clone()], [(0, 1, 30)])
    assert torch.equal(decode, verify[:1])
    other = torch.randn(3, 64, generator=g)
    xs = torch.cat([other, x])
    cs, sn = torch.cat([_rope(torch.arange(5, 8), 16)[0], cos]), torch.cat([_rope(torch.arange(5, 8), 16)[1], sin])
    packed, _ = stack.run(xs, cs, sn, [torch.randn(3, 2, 2, 64, 16, generator=g), cache.clone()],
                          [(0, 3, 5), (3, 19, 30)])
    assert torch.equal(packed[3:], verify)


def test_refuses_what_it_does_not_take():
    layers, stack, _ = _stack(3)
    cache = [torch.zeros(3, 2, 2, 64, 16)]
    assert stack.takes(torch.randn(512, 64), [(64 * i, 64 * i + 64, 0) for i in range(8)], cache * 8)
    assert not stack.takes(torch.randn(cpu_forward.MAX_TOKENS + 1, 64), [(0, cpu_forward.MAX_TOKENS + 1, 0)], cache)
    assert stack.takes(torch.randn(300, 64), [(0, 300, 0)], cache)  # a prompt
    assert not stack.takes(torch.randn(1, 64), [(0, 1, 0), (1, 1, 4)], cache * 2)  # a request with no new token
    assert not stack.takes(torch.randn(1, 64).to(torch.bfloat16), [(0, 1, 0)], cache)
    assert not stack.takes(torch.randn(1, 64), [(0, 1, 0)], [torch.zeros(3, 2, 2, 64, 16).to(torch.bfloat16)])
    assert not LayerStack.fits([LayerWeights(*(t.to(torch.bfloat16) for t in layers[0].tensors()))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_target_forward_takes_it_where_it_serves(dtype, monkeypatch, tmp_path):
    """Float32 decode and verify streams of the serving forward run in the C layers where
    the GEMV kernel pays, and give the logits of the Python layers; bfloat16 never does
    (its own C layers are tested in test_cpu_forward_bf16)."""
    target = TargetModel.from_pretrained(save_tiny(tmp_path, vocab=211), dtype=dtype)
    target.reference = False
    fused = target.fused()
    is_f32_stack = fused.stack is not None and fused.stack.DTYPE == torch.float32
    assert is_f32_stack == (dtype == torch.float32 and cpu_gemv_f32.pays() and cpu_forward.available())
    if not is_f32_stack:
        return
    calls = []
    real = fused.stack.run
    monkeypatch.setattr(fused.stack, "run", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    prompt = torch.randint(3, 200, (70,))
    kv = target.new_cache(90)
    target.forward_packed(prompt, [0, 70], [kv], logits_index=torch.empty(0, dtype=torch.int64))
    new = torch.randint(3, 200, (5,))
    ours = target.forward_packed(new, [0, 5], [kv], hidden_layers=(0, 1)).logits
    assert calls == [70, 5]
    kv.truncate(70)
    stack, fused.stack = fused.stack, None
    try:
        python = target.forward_packed(new, [0, 5], [kv], hidden_layers=(0, 1)).logits
    finally:
        fused.stack = stack
    torch.testing.assert_close(ours, python, atol=1e-4, rtol=1e-4)


def test_the_serving_forward_matches_the_reference_forward(tmp_path, monkeypatch):
    """Prompts, then three requests decoded and verified together: the serving forward
    (the C layers) gives the module-by-module reference forward's logits."""
    from dataplane.runner import ModelRunner

    d = save_tiny(tmp_path, vocab=97)
    ours = ModelRunner.reference("float32").load_target(d)
    ref = ModelRunner.reference("float32").load_target(d)
    ref.reference = True
    stack = ours.fused().stack
    if stack is None:
        assert not (cpu_forward.available() and cpu_gemv_f32.pays())
        return
    calls = []
    real = stack.run
    monkeypatch.setattr(stack, "run", lambda *a, **k: calls.append(len(a[4])) or real(*a, **k))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 90, (n,), generator=g) for n in (11, 30, 5)]
    caches = {m: [m.new_cache(96) for _ in prompts] for m in (ours, ref)}
    for b, p in enumerate(prompts):
        for m in (ours, ref):
            m.forward_packed(p, [0, len(p)], [caches[m][b]])
    for lengths in ((1, 1, 1), (4, 16, 1), (1, 9, 3)):
        stream = torch.randint(3, 90, (sum(lengths),), generator=g)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        a = ours.forward_packed(stream, cu, caches[ours]).logits
        b = ref.forward_packed(stream, cu, caches[ref]).logits
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert calls == [1, 1, 1, 3, 3, 3]  # the prompts and every step in one call each
