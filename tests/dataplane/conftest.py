"""Fixtures of the dataplane tests: a node on a tiny target served over real HTTP."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn

from adaflash.config import load_config
from dataplane.drafter import new_drafter
from dataplane.drafter_io import save_bundle
from dataplane.node import Node
from dataplane.server import create_app
from dataplane.tokenizer import Tokenizer

TOKEN = "test-admin-token"


class LiveServer:
    def __init__(self, app):
        self.config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def tiny_vocab_dir(tmp_path_factory, real_target_dir):
    """A tiny random target with the real tokenizer's vocabulary and tokenizer files."""
    from tests.tiny_models import save_tiny

    d = save_tiny(tmp_path_factory.mktemp("tiny-vocab"), vocab=49152, hidden=32, layers=2, heads=2, kv_heads=1)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = real_target_dir / f
        if src.exists():
            (d / f).write_bytes(src.read_bytes())
    return d


@pytest.fixture(scope="module")
def tiny_node(tmp_path_factory, tiny_vocab_dir):
    """A node on the real tokenizer with a tiny target that shares its vocabulary."""
    d = tiny_vocab_dir
    home = tmp_path_factory.mktemp("home")
    settings = load_config(home=home)
    settings.model.path = str(d)
    settings.model.max_model_len = 512
    settings.dataplane.block_size = 8
    settings.dataplane.max_prompt_tokens = 200
    settings.dataplane.max_new_tokens_limit = 64
    from dataplane.model import TargetModel

    target = TargetModel.from_pretrained(d)
    bundle = tmp_path_factory.mktemp("drafter") / "v1"
    from dataplane.target_cache import target_identity

    save_bundle(new_drafter(target, seed=1, num_layers=1, n_target_layers=2, block_size=8), bundle,
                target_identity(d), version="v1")
    settings.dataplane.drafter = str(bundle)
    node = Node(settings, target=target, tokenizer=Tokenizer(d), target_dir=d)
    node.engine.start()
    yield node
    node.engine.stop()


@pytest.fixture(scope="module")
def server(tiny_node):
    with LiveServer(create_app(tiny_node, TOKEN)) as s:
        yield s
