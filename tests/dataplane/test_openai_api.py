"""The ``openai`` package against real nodes (uvicorn on loopback) in ar, fixed and adaptive.

A tiny random target with the real vocabulary and tokenizer, batch-invariant numerics, a
random drafter: every mode must give the same greedy text and logprobs, the same seeded
samples (also while other traffic runs), and the same grammar-constrained JSON.
"""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import openai
import pytest

from adaflash.config import load_config
from dataplane.drafter import new_drafter
from dataplane.drafter_io import save_bundle
from dataplane.model import TargetModel
from dataplane.node import Node
from dataplane.server import create_app
from dataplane.target_cache import target_identity
from dataplane.tokenizer import Tokenizer
from tests.dataplane.conftest import TOKEN, LiveServer

MODES = ("ar", "fixed", "adaptive")
USER = [{"role": "user", "content": "Name three colours."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"enum": ["cat", "dog", "bird"]},
        "legs": {"type": "array", "items": {"enum": [2, 4]}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"kind": {"enum": ["person", "farm"]}, "happy": {"type": "boolean"}},
                  "required": ["kind", "happy"], "additionalProperties": False},
    },
    "required": ["animal", "legs", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_vocab_dir):
    target = TargetModel.from_pretrained(tiny_vocab_dir)
    bundle = tmp_path_factory.mktemp("drafter") / "v1"
    save_bundle(new_drafter(target, seed=1, num_layers=1, n_target_layers=2, block_size=8), bundle,
                target_identity(tiny_vocab_dir), version="v1")
    out, stack = {}, []
    for mode in MODES:
        settings = load_config(home=tmp_path_factory.mktemp(f"home-{mode}"))
        settings.model.path = str(tiny_vocab_dir)
        settings.model.max_model_len = 512
        dp = settings.dataplane
        dp.mode, dp.block_size, dp.batch_invariant, dp.breakeven = mode, 8, True, False
        dp.max_prompt_tokens, dp.max_new_tokens_limit, dp.drafter = 200, 64, str(bundle)
        node = Node(settings, target=target, tokenizer=Tokenizer(tiny_vocab_dir), target_dir=tiny_vocab_dir)
        node.engine.start()
        srv = LiveServer(create_app(node, TOKEN)).__enter__()
        stack.append((node, srv))
        out[mode] = (node, srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0,
                                              timeout=120))
    yield out
    for node, srv in stack:
        srv.__exit__(None, None, None)
        node.engine.stop()


def _chat(client, **kw):
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=USER, **kw)


def test_models_list_and_retrieve(servers):
    node, _srv, client = servers["adaptive"]
    models = client.models.list().data
    assert [m.id for m in models] == [node.identity["id"]]
    assert models[0].model_extra["drafter"]["version"] == "v1"
    assert models[0].model_extra["drafter"]["mode"] == "adaptive"
    assert client.models.retrieve(node.identity["id"]).id == node.identity["id"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=USER)
    assert e.value.body["code"] == "model_not_found"


def _chat_logprobs(client):
    r = _chat(client, temperature=0, max_tokens=12, logprobs=True, top_logprobs=5, n=3,
              extra_body={"ignore_eos": True})
    return r, [[(t.token, t.logprob, t.bytes, [(a.token, a.logprob) for a in t.top_logprobs])
                for t in c.logprobs.content] for c in r.choices]


def test_chat_logprobs_n3_equal_across_modes(servers):
    ref, ref_lp = _chat_logprobs(servers["ar"][2])
    assert len(ref.choices) == 3 and ref.usage.completion_tokens == 36
    assert [c.index for c in ref.choices] == [0, 1, 2]
    assert len({c.message.content for c in ref.choices}) == 1  # greedy: n identical answers
    for content in ref_lp:
        assert len(content) == 12
        for token, logprob, raw, top in content:
            assert len(top) == 5 and top[0] == (token, logprob) and logprob <= 0.0
            assert bytes(raw).decode("utf-8", errors="replace") == token
    for mode in ("fixed", "adaptive"):
        r, lp = _chat_logprobs(servers[mode][2])
        assert [c.message.content for c in r.choices] == [c.message.content for c in ref.choices], mode
        assert lp == ref_lp, mode
        assert r.usage.model_extra["speculative"]["draft_tokens"] > 0  # it really speculated


def test_completion_legacy_logprobs(servers):
    outs = []
    for mode in MODES:
        r = servers[mode][2].completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time",
                                                max_tokens=10, temperature=0, logprobs=3,
                                                extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert all(len(t) <= 3 and max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs,
                                                                         strict=True))
        outs.append((r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert outs[1] == outs[0] and outs[2] == outs[0]


def test_completion_stream_logprobs_match(servers):
    client = servers["fixed"][2]
    kw = {"model": "SmolLM2-135M-Instruct", "prompt": "The sea is", "max_tokens": 12, "temperature": 0,
          "logprobs": 2, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw).choices[0]
    text, tokens, offsets = "", [], []
    for chunk in client.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs:
            tokens += c.logprobs.tokens
            offsets += c.logprobs.text_offset
    assert text == full.text
    assert tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset


def _seeded(client, seed=42):
    r = _chat(client, temperature=1.8, seed=seed, n=2, max_tokens=16, logprobs=True,
              extra_body={"ignore_eos": True})
    return [c.message.content for c in r.choices]


def test_seed_reproducible_across_modes_and_traffic(servers):
    ref = _seeded(servers["ar"][2])
    assert ref[0] != ref[1]  # each choice has its own stream
    assert _seeded(servers["ar"][2], seed=43) != ref
    for mode in ("fixed", "adaptive"):
        client = servers[mode][2]
        stop = threading.Event()

        def traffic(client=client, stop=stop):  # unrelated sampled and greedy requests around ours
            while not stop.is_set():
                _chat(client, temperature=1.0, max_tokens=8, n=2)
                _chat(client, temperature=0, max_tokens=8)

        threads = [threading.Thread(target=traffic) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            got = _seeded(client)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert got == ref, mode


def test_penalties_equal_across_modes(servers):
    kw = {"temperature": 0, "max_tokens": 16, "presence_penalty": 0.7, "frequency_penalty": 1.2,
          "extra_body": {"ignore_eos": True}}
    texts = [_chat(servers[mode][2], **kw).choices[0].message.content for mode in MODES]
    assert texts[1] == texts[0] and texts[2] == texts[0]
    plain = _chat(servers["ar"][2], temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content != texts[0]


def test_streaming_with_usage_and_logprobs(servers):
    client = servers["adaptive"][2]
    kw = {"temperature": 0, "max_tokens": 14, "logprobs": True, "top_logprobs": 2, "n": 2,
          "extra_body": {"ignore_eos": True}}
    full = _chat(client, **kw)
    text, tokens, finish, usage = ["", ""], [[], []], [None, None], None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **kw):
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert chunk.usage is None
        c = chunk.choices[0]
        text[c.index] += c.delta.content or ""
        tokens[c.index] += [(t.token, t.logprob) for t in (c.logprobs.content if c.logprobs else [])]
        finish[c.index] = c.finish_reason or finish[c.index]
    for i in range(2):
        assert text[i] == full.choices[i].message.content
        assert tokens[i] == [(t.token, t.logprob) for t in full.choices[i].logprobs.content]
    assert finish == ["length", "length"]
    assert usage.completion_tokens == 28 and usage.prompt_tokens == full.usage.prompt_tokens
    plain = list(_chat(client, stream=True, temperature=0, max_tokens=4))
    assert all(c.usage is None for c in plain)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 5)])
def test_json_schema_valid_and_equal_across_modes(servers, temperature, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    texts = []
    for mode in MODES:
        r = _chat(servers[mode][2], temperature=temperature, seed=seed, max_tokens=64, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        texts.append(r.choices[0].message.content)
    assert texts[1] == texts[0] and texts[2] == texts[0]


def test_bad_requests_get_openai_errors(servers):
    _node, srv, client = servers["adaptive"]
    cases = [({"n": 100}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"),
             ({"frequency_penalty": -3}, "frequency_penalty"), ({"top_logprobs": 3}, "top_logprobs"),
             ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
             ({"stream_options": {"include_usage": True}}, "stream_options"),
             ({"logit_bias": {"5": 10}}, "logit_bias"), ({"tools": [{"type": "function"}]}, "tools"),
             ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
              "response_format")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, max_tokens=2, extra_body=extra)
        body = e.value.body
        assert set(body) == {"message", "type", "param", "code"} and param in body["message"], body
    r = httpx.get(f"{srv.url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(f"{srv.url}/v1/completions", content=b'{"prompt": "' + b"x" * 2_000_000 + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{srv.url}/v2/whatever").json()["error"]["code"] == "unknown_route"


def test_max_completion_tokens_and_openapi(servers):
    _node, srv, client = servers["ar"]
    r = _chat(client, max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    spec = httpx.get(f"{srv.url}/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in body["properties"] and "ChatMessage" in spec["components"]["schemas"]
    assert "/v1/models" in spec["paths"] and "/admin/drafter" in spec["paths"]


def test_overload_is_429(servers):
    node, _srv, client = servers["ar"]
    node.settings.dataplane.max_waiting = 0
    try:
        with pytest.raises(openai.RateLimitError):
            _chat(client, max_tokens=2)
    finally:
        node.settings.dataplane.max_waiting = 4096
    assert _chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("uri,fragment", [("file:///etc", "is not a drafter bundle"),
                                          ("/nonexistent/bundle", "does not exist"),
                                          ("http://127.0.0.1:9/drafters/v2", "unreachable")])
def test_admin_load_from_bad_uri_is_409_and_node_keeps_serving(servers, uri, fragment):
    node, srv, client = servers["adaptive"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{srv.url}/admin/drafter", json={"version": "v9", "uri": uri}, headers=auth, timeout=30)
    assert r.status_code == 409, r.text
    assert fragment in r.json()["error"]["message"] and r.json()["error"]["code"] == "drafter_refused"
    assert node.engine.drafter_version == "v1"
    assert _chat(client, max_tokens=3).usage.model_extra["speculative"]["drafter_version"] == "v1"
