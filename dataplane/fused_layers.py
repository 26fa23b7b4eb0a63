"""The serving forward of one decoder layer, with its weights fused and laid out once.

A CPU decode step is bound by streaming the weights, and in eager PyTorch every call
costs a few microseconds more: one step of SmolLM2-135M made 211 matrix products and
about 900 small element-wise calls. Here q/k/v are one matrix and gate/up another (121
products a step), bfloat16 weights are prepacked for oneDNN
(``dataplane.kernels.cpu_linear``), the rotary tables are cast once per forward, q and k
rotate together, and in bfloat16 on CPU the norms and the rotation are one call each
into C (``dataplane.kernels.cpu_elementwise``). The module parameters of
``dataplane.model`` stay the source of truth and become views of the fused matrices, so
the reference path (batch-invariant numerics) and state dicts see the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dataplane.kernels import cpu_forward, cpu_forward_bf16
from dataplane.kernels.cpu_elementwise import rms_norm, rotary
from dataplane.kernels.cpu_forward import LayerStack, LayerWeights
from dataplane.kernels.cpu_forward_bf16 import LayerStackBF16
from dataplane.kernels.cpu_linear import PackedLinear


def _fuse(linears: list[nn.Linear]) -> PackedLinear:
    """Concatenate the rows of ``linears`` into one matrix; make each module's weight a view of it."""
    w = torch.cat([m.weight.detach() for m in linears], dim=0).contiguous()
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([m.bias.detach() for m in linears]).contiguous()
    row = 0
    for m in linears:
        n = m.out_features
        m.weight = nn.Parameter(w[row : row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return PackedLinear(w, bias)


class FusedLayer:
    """Fused weights of one ``DecoderLayer`` (built by ``FusedModel``)."""

    def __init__(self, layer: nn.Module):
        att, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads, self.head_dim = att.heads, att.kv_heads, att.head_dim
        self.q_norm, self.k_norm = att.q_norm, att.k_norm
        self.qkv = _fuse([att.q_proj, att.k_proj, att.v_proj])
        self.o = PackedLinear(att.o_proj.weight.detach())
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        self.inter = mlp.gate_proj.out_features
        self.down = PackedLinear(mlp.down_proj.weight.detach())
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """x [T, H]; cos, sin [T, 1, d] in x's dtype; attend(q, k, v) -> [T, heads * d]."""
        T, hd = x.shape[0], self.head_dim
        h = rms_norm(x, self.ln1.weight, self.ln1.eps)
        qkv = self.qkv(h).view(T, self.heads + 2 * self.kv_heads, hd)
        qk, v = qkv[:, : self.heads + self.kv_heads], qkv[:, self.heads + self.kv_heads :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.heads]), self.k_norm(qk[:, self.heads :])], dim=1)
        qk = rotary(qk, cos, sin)
        x = x + self.o(attend(qk[:, : self.heads], qk[:, self.heads :], v))
        h = rms_norm(x, self.ln2.weight, self.ln2.eps)
        gu = self.gate_up(h)
        return x + self.down(F.silu(gu[:, : self.inter]) * gu[:, self.inter :])


class FusedModel:
    """Every layer of a ``TargetModel`` fused, plus its output head."""

    def __init__(self, model: nn.Module):
        with torch.inference_mode(False), torch.no_grad():  # fused weights keep version counters
            self.layers = [FusedLayer(layer) for layer in model.model.layers]
            self.lm_head = PackedLinear(model.lm_head.weight.detach())
        self.key = fused_key(model)
        self.stack = self._stack(model)

    def _stack(self, model: nn.Module) -> LayerStack | LayerStackBF16 | None:
        """The layers for the C forward of their precision (``kernels.cpu_forward`` in float32,
        ``kernels.cpu_forward_bf16`` in bfloat16), where it serves them."""
        if any(layer.q_norm is not None for layer in self.layers):
            return None
        a = model.args
        eps = self.layers[0].ln1.eps
        weights = [LayerWeights(f.ln1.weight.detach(), f.qkv.weight, f.o.weight, f.ln2.weight.detach(),
                                f.gate_up.weight, f.down.weight) for f in self.layers]
        if weights[0].qkv.dtype == torch.bfloat16:
            products = [(f.qkv, f.o, f.gate_up, f.down) for f in self.layers]
            return cpu_forward_bf16.stack_of(weights, products, a.num_heads, a.num_kv_heads, eps)
        return cpu_forward.stack_of(weights, a.num_heads, a.num_kv_heads, eps)


def fused_key(model: nn.Module) -> tuple:
    """Identifies the weights a ``FusedModel`` was built from (rebuilt when they change)."""
    p = [model.model.layers[0].self_attn.q_proj.weight, model.lm_head.weight]
    return tuple((t.data_ptr(), -1 if t.is_inference() else t._version, t.dtype, t.device) for t in p)
