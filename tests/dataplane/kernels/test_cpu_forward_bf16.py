"""The bfloat16 layers in one C call (dataplane/kernels/forward_bf16.c): against the torch
reference in bfloat16 and against the Python layers it replaces, each request's rows
independent of the rest of the stream, and where the target's forward takes it (bfloat16
on a CPU where a tiled kernel serves the products) and where it does not."""

from __future__ import annotations

import pytest
import torch

from dataplane.kernels import cpu_attention, cpu_elementwise, cpu_forward_bf16
from dataplane.kernels.cpu_forward import LayerWeights, layers_torch
from dataplane.kernels.cpu_forward_bf16 import LayerStackBF16
from dataplane.kernels.cpu_linear import PackedLinear, kernel_plan
from dataplane.model import TargetModel
from tests.tiny_models import save_tiny

BF = torch.bfloat16


def _stack(seed: int, H=64, heads=4, kvh=2, d=16, inter=96, L=3):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.1):
        return (torch.randn(*shape, generator=g) * s).to(BF)

    layers = [LayerWeights(1 + r(H), r((heads + 2 * kvh) * d, H), r(H, heads * d), 1 + r(H), r(2 * inter, H),
                           r(H, inter)) for _ in range(L)]
    products = [tuple(PackedLinear(m) for m in (w.qkv, w.o, w.gate_up, w.down)) for w in layers]
    return layers, cpu_forward_bf16.stack_of(layers, products, heads, kvh, 1e-5), g


def _rope(pos: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = pos.unsqueeze(1).float() * (10000.0 ** (-torch.arange(0, d, 2).float() / d)).repeat(2).unsqueeze(0)
    return ang.cos().to(BF), ang.sin().to(BF)


def test_available_exactly_where_its_kernels_serve():
    serves = (kernel_plan().tiled is not None and cpu_elementwise.available() and cpu_attention.available())
    assert cpu_forward_bf16.available() == serves
    assert (_stack(0)[1] is not None) == serves


@pytest.mark.parametrize("bounds", [
    [(0, 1, 40)],  # a decode
    [(0, 16, 40)],  # a verify of sixteen
    [(0, 1, 3), (1, 5, 17), (5, 12, 0), (12, 13, 9)],  # decodes, verifies and a short prompt
    [(0, 64, 10), (64, 128, 0), (128, 300, 5)],  # more rows than one tiled call takes
])
def test_equals_the_reference(bounds):
    layers, stack, g = _stack(len(bounds))
    if stack is None:
        assert not cpu_forward_bf16.available()
        return
    T = bounds[-1][1]
    x = torch.randn(T, 64, generator=g).to(BF)
    x_before = x.clone()
    pos = torch.cat([torch.arange(st, st + e - s) for s, e, st in bounds])
    cos, sin = _rope(pos, 16)
    base = [torch.randn(3, 2, 2, 320, 16, generator=g) for _ in bounds]
    c_ref, c_ours = [c.clone() for c in base], [c.clone() for c in base]
    want_x, want_h = layers_torch(x, layers, 4, 2, 1e-5, cos, sin, c_ref, bounds, (0, 2, 0))
    assert stack.takes(x, bounds, c_ours)
    got_x, got_h = stack.run(x, cos, sin, c_ours, bounds, (0, 2, 0))
    assert got_x.dtype == got_h.dtype == BF
    # bfloat16 rounding of sums taken in another order: a few steps of 2^-8 at most
    torch.testing.assert_close(got_x.float(), want_x.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_h.float(), want_h.float(), atol=3e-2, rtol=3e-2)
    assert (got_x == want_x).float().mean() > 0.6  # most values are the same bfloat16
    for a, b in zip(c_ours, c_ref, strict=True):  # the new keys and values stored where the reference stores them
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert torch.equal(x, x_before)  # the input is left as it was: the output is new


def test_a_requests_rows_do_not_depend_on_the_rest_of_the_stream():
    """The same verify alone and beside other requests: bit for bit alike; and a decode of
    its first token too where the tiled kernel serves one row (no GEMV in the plan)."""
    layers, stack, g = _stack(7)
    if stack is None:
        return
    x = torch.randn(16, 64, generator=g).to(BF)
    cos, sin = _rope(torch.arange(30, 46), 16)
    cache = torch.randn(3, 2, 2, 64, 16, generator=g)
    verify, _ = stack.run(x, cos, sin, [cache.clone()], [(0, 16, 30)])
    other = torch.randn(5, 64, generator=g).to(BF)
    c2, s2 = _rope(torch.arange(5, 10), 16)
    packed, _ = stack.run(torch.cat([other, x]), torch.cat([c2, cos]), torch.cat([s2, sin]),
                          [torch.randn(3, 2, 2, 64, 16, generator=g), cache.clone()], [(0, 5, 5), (5, 21, 30)])
    assert torch.equal(packed[5:], verify)
    if cpu_forward_bf16.kernel_pointers()[1] == 0:
        decode, _ = stack.run(x[:1], cos[:1], sin[:1], [cache.clone()], [(0, 1, 30)])
        assert torch.equal(decode, verify[:1])


def test_refuses_what_it_does_not_take():
    layers, stack, _ = _stack(3)
    if stack is None:
        return
    cache = [torch.zeros(3, 2, 2, 64, 16)]
    assert stack.takes(torch.randn(512, 64).to(BF), [(64 * i, 64 * i + 64, 0) for i in range(8)], cache * 8)
    assert not stack.takes(torch.randn(cpu_forward_bf16.MAX_TOKENS + 1, 64).to(BF),
                           [(0, cpu_forward_bf16.MAX_TOKENS + 1, 0)], cache)
    assert not stack.takes(torch.randn(1, 64).to(BF), [(0, 1, 0), (1, 1, 4)], cache * 2)  # a request with no token
    assert not stack.takes(torch.randn(1, 64), [(0, 1, 0)], cache)  # float32 rows
    assert not stack.takes(torch.randn(1, 64).to(BF), [(0, 1, 0)], [torch.zeros(3, 2, 2, 64, 16).to(BF)])
    f32 = [LayerWeights(*(t.float() for t in layers[0].tensors()))]
    assert not LayerStackBF16.fits(f32, [tuple(PackedLinear(m) for m in (f32[0].qkv, f32[0].o))])


def test_the_target_forward_takes_it_where_it_serves(monkeypatch, tmp_path):
    """bfloat16 prompts, decodes and verifies of the serving forward run in the C layers
    where its kernels serve, and give the logits of the Python layers."""
    target = TargetModel.from_pretrained(save_tiny(tmp_path, vocab=211), dtype=BF)
    target.reference = False
    fused = target.fused()
    assert (fused.stack is not None) == cpu_forward_bf16.available()
    if fused.stack is None:
        return
    assert isinstance(fused.stack, LayerStackBF16)
    calls = []
    real = fused.stack.run
    monkeypatch.setattr(fused.stack, "run", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    prompt = torch.randint(3, 200, (40,))
    kv = target.new_cache(90)
    target.forward_packed(prompt, [0, 40], [kv], logits_index=torch.empty(0, dtype=torch.int64))
    for n in (1, 5):
        new = torch.randint(3, 200, (n,))
        ours = target.forward_packed(new, [0, n], [kv], hidden_layers=(0, 1))
        kv.truncate(40)
        stack, fused.stack = fused.stack, None
        try:
            python = target.forward_packed(new, [0, n], [kv], hidden_layers=(0, 1))
        finally:
            fused.stack = stack
        kv.truncate(40)
        torch.testing.assert_close(ours.logits.float(), python.logits.float(), atol=5e-2, rtol=2e-2)
        torch.testing.assert_close(ours.hidden.float(), python.hidden.float(), atol=5e-2, rtol=2e-2)
    assert calls == [40, 1, 5]
