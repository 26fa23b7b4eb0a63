"""A tiny random-weight Llama target with a byte-level tokenizer and chat template, on disk.

It has the same layout as the converted real target (config.json, model.safetensors,
tokenizer files, target.json) so every learner path runs unchanged, in milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dataplane.model import ModelArgs, TargetModel

TARGET_ID = "tiny-llama"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _save_tokenizer(d: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                 pad_token="<|im_end|>", unk_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                 chat_template=CHAT_TEMPLATE)
    hf.save_pretrained(str(d))
    return len(vocab)


def make_tiny_target(d: Path, seed: int = 0, num_layers: int = 6, hidden: int = 64) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    vocab = _save_tokenizer(d)
    cfg = {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
           "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": hidden // 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
           "eos_token_id": 2, "bos_token_id": 1, "max_position_embeddings": 4096}
    torch.manual_seed(seed)
    model = TargetModel(ModelArgs.from_hf(cfg))
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state = {k: v for k, v in state.items() if not k.startswith("rotary")}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "target.json").write_text(json.dumps({"id": TARGET_ID, "sha256": "0" * 64}))
    return d


def make_record(tenant: str = "acme", prompt: str = "What is two plus two?", response: str = "Four, of course.",
                target_id: str = TARGET_ID, sha256: str = "0" * 64, **kw):
    from adaflash.contracts.feedback import FeedbackRecord

    base = dict(tenant_id=tenant, node_id="node-1", request_id="req", target_model={"id": target_id, "sha256": sha256},
                drafter_version="1", mode="adaptive", sampling={"temperature": 0.0, "top_p": 1.0},
                prompt_text=prompt, response_text=response,
                stats={"tau_mean": 1.5, "verify_tokens": 10, "draft_ms": 1.0, "verify_ms": 2.0})
    base.update(kw)
    if "record_id" not in kw:  # a training record: never one of the ids reserved for evaluation
        base["record_id"] = training_record_id()
    return FeedbackRecord.model_validate(base)


def training_record_id() -> str:
    import uuid

    from adaflash.contracts.feedback import is_evaluation_record

    while True:
        rid = uuid.uuid4().hex
        if not is_evaluation_record(rid):
            return rid


def produce(bootstrap: str, topic: str, values: list[tuple[str, bytes]]) -> None:
    """Send (key, value) pairs with the contract's headers and wait for every ack."""
    from kafka import KafkaProducer

    from adaflash.contracts import FEEDBACK_SCHEMA_VERSION, HEADER_SCHEMA_VERSION, HEADER_TRACEPARENT

    prod = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        futures = [prod.send(topic, key=k.encode(), value=v,
                             headers=[(HEADER_SCHEMA_VERSION, str(FEEDBACK_SCHEMA_VERSION).encode()),
                                      (HEADER_TRACEPARENT, b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")])
                   for k, v in values]
        prod.flush()
        for f in futures:
            f.get(timeout=30)
    finally:
        prod.close()


def read_all(bootstrap: str, topic: str, expect: int, timeout_s: float = 20.0) -> list:
    """Every message of a topic (no group), waiting until ``expect`` arrived or the timeout."""
    import time

    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        parts = c.partitions_for_topic(topic) or set()
        c.assign([TopicPartition(topic, p) for p in parts])
        c.seek_to_beginning()
        out, deadline = [], time.monotonic() + timeout_s
        while len(out) < expect and time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=500).values():
                out += msgs
        return out
    finally:
        c.close()


def committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offsets (partitions without one left out), read without joining."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        out = {p: c.committed(TopicPartition(topic, p)) for p in c.partitions_for_topic(topic) or set()}
        return {p: o for p, o in out.items() if o is not None}
    finally:
        c.close(autocommit=False)


def log_ends(bootstrap: str, topic: str, expect: int) -> dict[int, int]:
    """Per partition, one past the last offset, from reading the topic (Tansu's ListOffsets is not used)."""
    ends: dict[int, int] = {}
    for m in read_all(bootstrap, topic, expect):
        ends[m.partition] = max(ends.get(m.partition, 0), m.offset + 1)
    return ends
