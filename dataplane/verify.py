"""Verification API the engine calls after the target's verify forward.

The engine packs each request's k_hat tokens into one stream (``dataplane.kernels.pack_drafts``),
runs the target once over it, and hands the logits here. Per request the result says how
many drafts were accepted and which token the target adds after them; the request then
emits ``accepted + 1`` tokens.

Target and drafter distributions go through the same ``process_logits`` (temperature,
then top-p), which is what keeps rejection sampling lossless with respect to the
processed target distribution. Temperature 0 means greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dataplane.kernels import greedy_accept, rejection_accept
from dataplane.kernels.segments import expand_to_tokens


@dataclass(frozen=True)
class VerifyResult:
    """accepted: [B] int64 drafts kept per request; bonus: [B] int64 token the target adds."""

    accepted: torch.Tensor
    bonus: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        """[B] int64 tokens each request commits this step."""
        return self.accepted + 1

    def emitted_tokens(self, token_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> list[list[int]]:
        """Tokens each request commits: its accepted drafts followed by the bonus token (host lists)."""
        tokens, cu = token_ids.tolist(), cu_seqlens.tolist()
        accepted, bonus = self.accepted.tolist(), self.bonus.tolist()
        return [tokens[s + 1 : s + 1 + a] + [t] for s, a, t in zip(cu[:-1], accepted, bonus, strict=True)]


def _as_param(value: torch.Tensor | float, shape: torch.Size, device: torch.device) -> torch.Tensor:
    return torch.broadcast_to(torch.as_tensor(value, dtype=torch.float32, device=device), shape)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest highest-probability set whose mass reaches top_p, renormalised.

    Args:
        probs: [..., V] normalised probabilities.
        top_p: [...] in (0, 1]; rows with top_p >= 1 are returned unchanged.
    Returns:
        [..., V] float32. Among equal probabilities the lower token id ranks first, so the
        cut is deterministic; the most likely token is always kept.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p[..., None]
    keep_sorted[..., 0] = True
    # Skip the cut where top_p >= 1: rounding in the cumsum could otherwise drop the tail.
    keep_sorted |= (top_p >= 1)[..., None]
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))
    return kept / kept.sum(dim=-1, keepdim=True)


def process_logits(
    logits: torch.Tensor, temperature: torch.Tensor | float, top_p: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """Logits to the sampling distribution: temperature scaling, softmax, top-p, renormalise.

    Args:
        logits: [..., V].
        temperature: [...] (or anything broadcastable to it); 0 gives the one-hot argmax
            distribution (greedy, lowest token id on ties).
        top_p: [...] (or broadcastable) in (0, 1].
    Returns:
        [..., V] float32 probabilities.
    """
    batch_shape = logits.shape[:-1]
    temperature = _as_param(temperature, batch_shape, logits.device)
    top_p = _as_param(top_p, batch_shape, logits.device)
    logits = logits.to(torch.float32)
    greedy = temperature <= 0
    safe_temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / safe_temp[..., None], dim=-1)
    if bool((top_p < 1).any()):
        probs = top_p_filter(probs, top_p)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[..., None], one_hot, probs)
    return probs


def sample_draft_tokens(draft_probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw draft tokens from processed drafter distributions.

    Args:
        draft_probs: [..., V] from ``process_logits`` (e.g. [B, K-1, V]).
        generator: for reproducible draws, on any device (the draw happens there).
    Returns:
        [...] int64 token ids (tokens of probability 0 are never drawn).
    """
    flat = draft_probs.reshape(-1, draft_probs.shape[-1]).to(torch.float32)
    if generator is not None:  # drawn where the generator lives (a request's is on the host)
        flat = flat.to(generator.device)
    return torch.multinomial(flat, 1, generator=generator).reshape(draft_probs.shape[:-1]).to(draft_probs.device)


def _uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    # Drawn on the generator's device, then moved: a CPU generator gives the same draws
    # whichever device verifies.
    if generator is None:
        return torch.rand(n, device=device)
    return torch.rand(n, generator=generator, device=generator.device).to(device)


def request_uniforms(lengths: list[int], generators: list[torch.Generator | None],
                     device: torch.device) -> torch.Tensor:
    """The [T + B] uniforms of a stream whose request b draws from its own generator.

    Request b verifying lengths[b] tokens draws lengths[b] + 1 uniforms (acceptance, then
    its bonus), as ``verify_sampling`` of that request alone would; they are laid out as
    ``verify_sampling`` reads them: all T acceptance draws in stream order, then B bonus draws.
    """
    per = [_uniforms(n + 1, g, device) for n, g in zip(lengths, generators, strict=True)]
    if not per:
        return torch.zeros(0, device=device)
    return torch.cat([u[:-1] for u in per] + [torch.stack([u[-1] for u in per])])


def verify_greedy(
    target_logits: torch.Tensor, token_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> VerifyResult:
    """Greedy verification.

    Args:
        target_logits: [T, V]; token_ids: [T] int64; cu_seqlens: [B+1] int64.
    Returns:
        VerifyResult with accepted [B], bonus [B].
    """
    accepted, bonus = greedy_accept(target_logits, token_ids, cu_seqlens)
    return VerifyResult(accepted, bonus)


def verify_sampling(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> VerifyResult:
    """Rejection-sampling verification.

    Args:
        target_logits: [T, V] raw target logits (processed here like the drafter's were).
        draft_probs: [T, V] processed drafter probabilities along the stream (row j is the
            distribution x_{j+1} was drawn from; see ``pack_draft_probs``).
        token_ids: [T] int64; cu_seqlens: [B+1] int64.
        temperature: [B] per request (0 gives one-hot target rows).
        top_p: [B] per request.
        generator: source of the T + B uniforms (T for acceptance, then B for bonus tokens).
        uniforms: [T + B] those draws given instead (``request_uniforms``: each request
            drawing from its own generator); ``generator`` is then unused.
    Returns:
        VerifyResult with accepted [B], bonus [B].
    """
    T, B = token_ids.numel(), cu_seqlens.numel() - 1
    device = target_logits.device
    cu = cu_seqlens.to(device)
    temp_tok = expand_to_tokens(torch.as_tensor(temperature, device=device), cu, T)
    top_p_tok = expand_to_tokens(torch.as_tensor(top_p, device=device), cu, T)
    target_probs = process_logits(target_logits, temp_tok, top_p_tok)
    u = _uniforms(T + B, generator, device) if uniforms is None else uniforms.to(device)
    accepted, bonus = rejection_accept(target_probs, draft_probs, token_ids, cu, u[:T], u[T:])
    return VerifyResult(accepted, bonus)


def verify(
    target_logits: torch.Tensor,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify a batch mixing greedy (temperature 0) and sampled requests.

    Greedy requests are verified by argmax and their draft_probs rows are never used; the
    others by rejection sampling. A batch of one kind runs only that path.

    Args:
        target_logits: [T, V]; token_ids: [T] int64; cu_seqlens: [B+1] int64.
        temperature: [B] per request, 0 = greedy.
        top_p: [B] per request (default 1.0 everywhere).
        draft_probs: [T, V] processed drafter probabilities; required if any temperature > 0.
        generator: see ``verify_sampling``; its draws do not depend on the greedy/sampled mix.
    Returns:
        VerifyResult with accepted [B], bonus [B].
    """
    temperature = torch.as_tensor(temperature, dtype=torch.float32)
    greedy = temperature <= 0
    if bool(greedy.all()):
        return verify_greedy(target_logits, token_ids, cu_seqlens)
    if draft_probs is None:
        raise ValueError("draft_probs is required when a request samples (temperature > 0)")
    if top_p is None:
        top_p = torch.ones_like(temperature)
    sampled = verify_sampling(
        target_logits, draft_probs, token_ids, cu_seqlens, temperature, top_p, generator
    )
    if not bool(greedy.any()):
        return sampled
    by_argmax = verify_greedy(target_logits, token_ids, cu_seqlens)
    greedy = greedy.to(by_argmax.accepted.device)
    return VerifyResult(
        accepted=torch.where(greedy, by_argmax.accepted, sampled.accepted),
        bonus=torch.where(greedy, by_argmax.bonus, sampled.bonus),
    )
