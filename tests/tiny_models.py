"""Tiny random-weight models of the target's family, saved like real Hugging Face checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_tiny(directory: Path, model_type: str = "llama", vocab: int = 97, hidden: int = 64, layers: int = 4,
              heads: int = 4, kv_heads: int = 2, seed: int = 0, embed_std: float = 1.0,
              tie: bool = True) -> Path:
    """Write config.json + model.safetensors of a random tiny decoder; returns the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    # Sharper logits than the default init so greedy decoding is not a sea of near-ties.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, embed_std)
        if not tie:
            model.get_output_embeddings().weight.normal_(0, embed_std)
    model.save_pretrained(directory, safe_serialization=True)
    (Path(directory) / "target.json").write_text(json.dumps({"id": f"tiny-{model_type}", "sha256": "0" * 64}))
    return Path(directory)


def save_tiny_servable(directory: Path, real_target_dir: Path) -> Path:
    """A tiny llama with the real target's vocabulary size, tokenizer files and chat template, and a
    target identity: what a node or a benchmark loads as its target."""
    d = save_tiny(directory, vocab=49152, hidden=32, layers=2, heads=2, kv_heads=1)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real_target_dir / f).exists():
            (d / f).write_bytes((real_target_dir / f).read_bytes())
    (d / "target.json").write_text(json.dumps({"id": "tiny", "sha256": "0" * 64}))
    return d
