"""Scrubbing in a child process: same placeholders, and a dead child fails closed then recovers."""

import pytest

from adaflash.contracts.feedback import FeedbackRecord
from governance.pii import ScrubError
from governance.scrub_process import ProcessScrubber


def _record(prompt: str) -> FeedbackRecord:
    return FeedbackRecord.model_validate({
        "tenant_id": "t1", "node_id": "n", "request_id": "r", "target_model": {"id": "x", "sha256": "0" * 64},
        "drafter_version": "v", "mode": "adaptive", "sampling": {"temperature": 0, "top_p": 1},
        "prompt_text": prompt, "response_text": "Reach me at jane.roe@example.com", "rounds": [],
        "stats": {"tau_mean": 1, "verify_tokens": 1, "draft_ms": 0, "verify_ms": 0}})


@pytest.fixture(scope="module")
def scrubber():
    s = ProcessScrubber(nice=5)
    yield s
    s.close()


def test_child_process_scrubs_like_inline(scrubber):
    out = scrubber.scrub_record(_record("My AWS key is AKIAIOSFODNN7EXAMPLE, call 212-555-0198"))
    text = out.record.prompt_text + out.record.response_text
    assert "AKIAIOSFODNN7EXAMPLE" not in text and "jane.roe@example.com" not in text
    assert "<EMAIL_ADDRESS>" in text and out.record.pii.get("EMAIL_ADDRESS") == 1


def test_dead_child_is_replaced(scrubber):
    scrubber.scrub_record(_record("warm up"))
    scrubber._proc.kill()
    scrubber._proc.join()
    again = scrubber.scrub_record(_record("Call John Smith at 212-555-0198"))
    assert "212-555-0198" not in again.record.prompt_text


def test_hung_child_fails_closed_then_recovers(scrubber):
    with pytest.raises(ScrubError, match="timed out"):
        scrubber.scrub_texts(["Call John Smith at 212-555-0198 " * 50], timeout_s=0.0)
    assert scrubber._proc is None  # the hung child was killed
    out = scrubber.scrub_record(_record("Call John Smith at 212-555-0198"))
    assert "212-555-0198" not in out.record.prompt_text
