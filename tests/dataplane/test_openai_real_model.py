"""The real target behind the openai package, adaptive mode with the starter drafter (short).

Greedy chat with logprobs equals the engine's ``ar`` on the same prompt (default numerics:
a difference must be a named float near-tie, and logprobs agree to 1e-3 before it), and a
json_object answer parses as a JSON object.
"""

from __future__ import annotations

import json

import openai
import pytest

from adaflash.config import DataplaneConfig, load_config
from dataplane.engine import Engine
from dataplane.node import Node
from dataplane.sequence import SamplingParams, Sequence
from dataplane.server import create_app
from tests.dataplane.conftest import TOKEN, LiveServer

pytestmark = pytest.mark.realmodel
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory, real_target, real_tokenizer, real_target_dir):
    settings = load_config(home=tmp_path_factory.mktemp("home"))
    settings.dataplane.mode = "adaptive"
    node = Node(settings, target=real_target, tokenizer=real_tokenizer, target_dir=real_target_dir)
    node.engine.start()
    with LiveServer(create_app(node, TOKEN)) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    node.engine.stop()


def test_greedy_logprobs_equal_ar(client, real_target, real_tokenizer):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, temperature=0,
                                       max_tokens=20, logprobs=True, top_logprobs=3)
    got = [(t.logprob, [a.logprob for a in t.top_logprobs]) for t in r.choices[0].logprobs.content]
    eos = real_tokenizer.eos_token_id
    engine = Engine(real_target, DataplaneConfig(mode="ar"), eos_token_ids=[eos], max_model_len=1024)
    ids = real_tokenizer.encode(real_tokenizer.apply_chat(MESSAGES))
    seq = Sequence(request_id="ar", prompt_ids=ids, params=SamplingParams(max_tokens=20, logprobs=3))
    engine.add(seq)
    engine.run_until_idle()
    ref = [(e.logprob, [v for _, v in e.top]) for e in seq.logprobs]
    text = real_tokenizer.decode(seq.output_ids)
    for j, ((lp, top), (ref_lp, ref_top)) in enumerate(zip(got, ref, strict=False)):
        gap = ref_top[0] - ref_top[1]
        if abs(lp - ref_lp) > 1e-3:
            assert gap < 1e-3, f"position {j}: logprob {lp} vs ar {ref_lp}, not a near-tie (gap {gap})"
            print(f"near-tie at position {j} (gap {gap})")
            return
        assert all(abs(a - b) < 1e-3 for a, b in zip(top, ref_top, strict=True))
    assert r.choices[0].message.content == text
    assert r.usage.model_extra["speculative"]["drafter_version"] is not None


def test_json_object_answer_parses(client):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=80, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}])
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    print(r.choices[0].message.content, r.usage.model_extra["speculative"])
