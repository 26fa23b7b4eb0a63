"""The OPD losses against float64 brute force, the clip's gradient, and the head's isolation."""

from __future__ import annotations

import math

import pytest
import torch

from learner import losses
from tests.learner.conftest import make_drafter

N, V = 7, 23


def _softmax(row):
    m = max(row)
    e = [math.exp(x - m) for x in row]
    s = sum(e)
    return [x / s for x in e]


def _inputs(seed=0, vd=None):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(N, V, generator=g) * 3
    vocab_map = torch.randperm(V, generator=g)[:vd] if vd else torch.empty(0, dtype=torch.int64)
    q = (torch.randn(N, vd or V, generator=g) * 3).requires_grad_(True)
    mask = torch.ones(N, dtype=torch.bool)
    mask[-2:] = False  # the tail of a block past the end of the response
    return q, p, mask, vocab_map


def _ref_terms(q, p, mask, vocab_map, delta):
    """Brute force in float64 Python: per valid position, hard CE, RKL, clipped RKL, FKL."""
    vm = vocab_map.tolist() if vocab_map.numel() else list(range(V))
    out = {"hard": [], "rkl": [], "clip": [], "fkl": []}
    for n in range(N):
        if not mask[n]:
            continue
        pn = _softmax([float(x) for x in p[n].double()])
        qn = _softmax([float(x) for x in q[n].detach().double()])
        rkl = sum(qn[j] * math.log(qn[j] / pn[y]) for j, y in enumerate(vm))
        clip = sum(min(qn[j] * math.log(qn[j] / pn[y]), delta) for j, y in enumerate(vm))
        zr = sum(pn[y] for y in vm)
        fkl = sum((pn[y] / zr) * math.log((pn[y] / zr) / qn[j]) for j, y in enumerate(vm))
        out["rkl"].append(rkl)
        out["clip"].append(clip)
        out["fkl"].append(fkl)
        top = max(range(V), key=lambda y: pn[y])
        if top in vm:
            out["hard"].append(-math.log(qn[vm.index(top)]))
    return {k: sum(v) / len(v) for k, v in out.items()}


@pytest.mark.parametrize("vd", [None, 15])
def test_losses_equal_float64_brute_force(vd):
    q, p, mask, vm = _inputs(1, vd)
    delta = 0.01
    ref = _ref_terms(q, p, mask, vm, delta)
    logp = losses.target_logprobs_on_draft_vocab(p, vm)
    top1 = losses.target_top1_in_draft_vocab(p, vm)
    q = q.detach()  # values only here; gradients are checked below
    assert float(losses.hard_ce(q, top1, mask)) == pytest.approx(ref["hard"], rel=1e-5)
    assert float(losses.reverse_kl(q, logp, mask)) == pytest.approx(ref["rkl"], rel=1e-5)
    clip, ratio = losses.reverse_kl_clipped(q, logp, mask, delta)
    assert float(clip) == pytest.approx(ref["clip"], rel=1e-5, abs=1e-7)
    assert 0.0 < float(ratio) < 1.0
    assert float(losses.forward_kl(q, p, mask, vm)) == pytest.approx(ref["fkl"], rel=1e-5)
    opd = losses.distill_loss(q, p, mask, kind="opd", alpha=0.8, delta=delta, vocab_map=vm)
    assert float(opd.loss) == pytest.approx(0.8 * ref["hard"] + 0.2 * ref["clip"], rel=1e-5)
    assert opd.parts["clip_ratio"] == pytest.approx(float(ratio))
    assert float(losses.distill_loss(q, p, mask, kind="osd", vocab_map=vm).loss) == pytest.approx(ref["fkl"], rel=1e-5)


def test_clipped_entries_pass_no_gradient():
    q, p, mask, vm = _inputs(2)
    delta = 0.01
    entries = losses.rkl_entries(q, losses.target_logprobs_on_draft_vocab(p, vm))
    entries.retain_grad()
    loss, _ = losses.clipped_sum(entries, mask, delta)
    loss.backward()
    above = entries.detach() > delta
    assert above[mask].any() and (~above[mask]).any()
    assert torch.all(entries.grad[above] == 0)
    assert torch.allclose(entries.grad[~above & mask.unsqueeze(1)], torch.tensor(1 / int(mask.sum())))
    # And through the softmax: the gradient on the logits equals the gradient of a float64
    # reference in which every clipped entry is replaced by the constant delta.
    q64 = q.detach().double().requires_grad_(True)
    logq = torch.log_softmax(q64, -1)
    e64 = logq.exp() * (logq - torch.log_softmax(p.double(), -1))
    ref = torch.where(e64.detach() > delta, torch.full_like(e64, delta), e64)
    ref_loss = ref[mask].sum() / int(mask.sum())
    ref_loss.backward()
    q.grad = None
    losses.reverse_kl_clipped(q, losses.target_logprobs_on_draft_vocab(p, vm), mask, delta)[0].backward()
    assert torch.allclose(q.grad.double(), q64.grad, atol=1e-6)


@pytest.mark.parametrize("kind", ["bce", "mse"])
def test_head_loss_leaves_every_drafter_gradient_at_zero(target, kind):
    drafter = make_drafter(target, seed=3)
    drafter.train().requires_grad_(True)
    L = 30
    tokens = torch.randint(3, target.args.vocab_size, (L,))
    with torch.no_grad():
        hidden = target.forward_packed(tokens, [0, L], [target.new_cache()],
                                       hidden_layers=tuple(drafter.config.target_layers)).hidden.clone()
    h = drafter.forward_train(hidden, tokens, torch.tensor([5, 12, 20]))
    out = losses.head_loss(drafter.length_head, h, torch.tensor([0.2, 0.5, 1.0]), kind)
    out.loss.backward()
    for name, prm in drafter.named_parameters():
        if name.startswith("length_head."):
            assert prm.grad is not None and prm.grad.abs().sum() > 0, name
        else:
            assert prm.grad is None or torch.all(prm.grad == 0), name
    assert set(out.parts) == {"head_mse", "head_mae"}


class _LogitHead(torch.nn.Module):
    """A head whose logit is a free parameter per block: logit(h) = z."""

    def __init__(self, z):
        super().__init__()
        self.z = torch.nn.Parameter(z)

    def logit(self, h):
        return self.z


def test_head_losses_equal_float64_references_and_bce_does_not_saturate():
    z = torch.tensor([-16.0, -3.0, 0.0, 2.5, 14.0])
    y = torch.tensor([0.2, 0.0, 0.5, 1.0, 0.3])
    h = torch.zeros(5, 4, 8)
    z64 = z.double().requires_grad_(True)
    a64 = 1 / (1 + torch.exp(-z64))
    bce64 = -(y.double() * torch.log(a64) + (1 - y.double()) * torch.log(1 - a64)).mean()
    bce64.backward()
    head = _LogitHead(z.clone())
    out = losses.head_loss(head, h, y, "bce")
    out.loss.backward()
    assert abs(float(out.loss.detach()) - float(bce64)) < 1e-5
    assert torch.allclose(head.z.grad.double(), z64.grad, atol=1e-7)
    # d bce / d z = (a_hat - a*) / B: a head pinned at a_hat = 0 with label 0.2 still gets
    # the full push, while MSE through the saturated sigmoid passes almost nothing.
    assert abs(float(head.z.grad[0]) - (-0.2 / 5)) < 1e-6
    mse_head = _LogitHead(z.clone())
    m = losses.head_loss(mse_head, h, y, "mse")
    m.loss.backward()
    mse64 = ((a64.detach() - y.double()) ** 2).mean()
    assert abs(float(m.loss.detach()) - float(mse64)) < 1e-6 and abs(out.parts["head_mse"] - float(mse64)) < 1e-6
    assert abs(float(mse_head.z.grad[0])) < 1e-7
    with pytest.raises(ValueError, match="unknown head loss"):
        losses.head_loss(head, h, y, "l1")
