import pytest

from governance.pii import PLACEHOLDER_RE, ScrubbedRecord, ScrubError
from tests.governance.canaries import CANARIES
from tests.governance.conftest import make_record


@pytest.mark.parametrize("entity,text,raws", CANARIES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CANARIES)])
def test_each_canary_is_scrubbed(scrubber, entity, text, raws):
    r = scrubber.scrub(text)
    for raw in raws:
        assert raw not in r.text
    assert r.counts.get(entity, 0) >= 1, (entity, r.counts)
    assert f"<{entity}>" in r.text


def test_placeholders_are_never_detected_again(scrubber):
    text = " ".join(t for _, t, _ in CANARIES)
    once = scrubber.scrub(text)
    twice = scrubber.scrub(once.text)
    assert twice.text == once.text
    assert twice.counts == {}
    assert scrubber.scrub("<PERSON> wrote to <EMAIL_ADDRESS> about <CREDIT_CARD>.").counts == {}


def test_plain_text_and_code_are_kept(scrubber):
    text = "Write a Python function that sorts a list: def f(xs): return sorted(xs)"
    assert scrubber.scrub(text).text == text
    sha = "Commit 3f786850e387550fdab836ed7e6dc881de23001b fixed it."
    assert "3f786850e387550fdab836ed7e6dc881de23001b" in scrubber.scrub(sha).text


def test_scrub_record_sets_counts_and_wraps(scrubber):
    rec = make_record(prompt="I am Margaret Thompson, mail margaret.thompson@examplecorp.com",
                      response="Hello Margaret Thompson")
    s = scrubber.scrub_record(rec)
    assert isinstance(s, ScrubbedRecord)
    assert "Thompson" not in s.record.prompt_text + s.record.response_text
    assert s.record.pii["EMAIL_ADDRESS"] == 1 and s.record.pii["PERSON"] >= 2
    assert rec.prompt_text.startswith("I am Margaret")  # the original is untouched
    assert PLACEHOLDER_RE.search(s.record.prompt_text)


def test_oversized_text_fails_closed(scrubber):
    with pytest.raises(ScrubError) as e:
        scrubber.scrub("Margaret Thompson " * 20_000)
    assert "Thompson" not in str(e.value)


def test_threads_share_one_scrubber(scrubber):
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"Mail margaret.thompson{i}@examplecorp.com now" for i in range(16)]
    with ThreadPoolExecutor(4) as ex:
        out = list(ex.map(scrubber.scrub, texts))
    assert all(r.text == "Mail <EMAIL_ADDRESS> now" for r in out)
