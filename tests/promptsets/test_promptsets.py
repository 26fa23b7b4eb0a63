"""The held-out split of shared/DATA.md is enforced by promptsets."""

import json

import pytest

import promptsets as ds


def test_split_rule():
    assert ds.is_heldout("chat", 0) and ds.is_heldout("chat", 30) and not ds.is_heldout("chat", 31)
    assert ds.is_heldout("code", 120) and ds.is_heldout("code", 163) and not ds.is_heldout("code", 119)
    assert ds.is_heldout("math", 1_000_000) and not ds.is_heldout("math", 999_999)
    with pytest.raises(ValueError):
        ds.is_heldout("poetry", 1)


def test_truncated_sharegpt_decoding(tmp_path, monkeypatch):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"},
                                              {"from": "gpt", "value": f"a{i}"}]} for i in range(25)]
    text = json.dumps(convs, indent=2)
    cut = text[: text.rfind('"q24"') + 3]  # cut inside the last element
    p = tmp_path / "sg.json"
    p.write_text(cut)
    got = list(ds.iter_sharegpt(str(p)))
    assert [i for i, _ in got] == list(range(24))
    monkeypatch.setenv("ADAFLASH_SHAREGPT_PATH", str(p))
    ds._chat_items.cache_clear()
    ds._chat_heldout_texts.cache_clear()
    try:
        held = ds.heldout_prompts("chat", 100)
        train = ds.train_texts("chat", 100)
        assert [h["prompt"] for h in held] == ["q0", "q10", "q20"]
        assert len(train) == 21 and all(int(t["id"].split("/")[1]) % 10 for t in train)
        assert train[0]["response"] == "a1"
    finally:
        ds._chat_items.cache_clear()
    ds._chat_heldout_texts.cache_clear()


@pytest.mark.parametrize("domain", ["code", "math"])
def test_train_never_heldout(domain):
    held = ds.heldout_prompts(domain, 50)
    train = ds.train_texts(domain, 2000) + ds.train_prompts(domain, 2000)
    held_ids = {h["id"] for h in held}
    assert held and train and not held_ids & {t["id"] for t in train}
    assert not {h["prompt"] for h in held} & {t["prompt"] for t in train}
    for t in train:
        assert not ds.is_heldout(domain, int(t["id"].split("/")[1]))


def test_code_split_sizes():
    assert len(ds.heldout_prompts("code", 1000)) == 44
    assert len(ds.train_texts("code", 1000)) == 120


def test_math_deterministic_and_labelled():
    a = ds.heldout_prompts("math", 3)
    assert a == ds.heldout_prompts("math", 3)
    assert a[0]["id"] == "synthetic-math/1000000" and a[0]["source"] == "synthetic"
    t = ds.train_texts("math", 2, offset=5)
    assert t[0]["id"] == "synthetic-math/5" and "The answer is" in t[0]["response"]


def test_real_sharegpt_split():
    held = ds.heldout_prompts("chat", 200)
    train = ds.train_texts("chat", 2000)
    assert len(held) == 200 and len(train) == 2000
    assert all(int(h["id"].split("/")[1]) % 10 == 0 for h in held)
    assert all(int(t["id"].split("/")[1]) % 10 != 0 for t in train)
    assert all(len(h["prompt"]) <= ds.MAX_PROMPT_CHARS for h in held)
    held_all = ds._chat_heldout_texts()
    assert not held_all & {t["prompt"] for t in train}


def test_write_jsonl(tmp_path):
    p = tmp_path / "x" / "rows.jsonl"
    assert ds.write_jsonl([{"a": 1}, {"b": "é"}], str(p)) == 2
    assert ds.read_jsonl(str(p)) == [{"a": 1}, {"b": "é"}]
