import pytest
import torch

from dataplane.model import ModelArgs, TargetModel


class ByteTok:
    """A stand-in tokenizer: bytes -> ids 3..258, chat template as plain markers."""

    eos_token_id = 2

    def encode(self, text):
        return [3 + b for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", "replace")

    def apply_chat(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@pytest.fixture(scope="session")
def tiny_target():
    torch.manual_seed(0)
    a = ModelArgs(vocab_size=260, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, eos_token_ids=[2])
    m = TargetModel(a)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.08)
    for n, p in m.named_parameters():
        if "norm" in n:
            torch.nn.init.ones_(p)
    return m.eval().requires_grad_(False)


@pytest.fixture
def tok():
    return ByteTok()
