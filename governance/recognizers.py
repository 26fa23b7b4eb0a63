"""Recognizers that raise the scrubber's recall beyond Presidio's defaults.

The small spaCy model misses many names, above all uncommon, hyphenated and non-English
ones ("Hi, my name is Zofia Kowalska-Nowak"). ``adaflash bench pii`` measures what each
part adds. What is here:

- names by structure: the words after "my name is" / "I'm" / "This is", in greetings
  ("Hi Lei,"), after sign-offs ("Best,\\nAna Souza", "-- \\n…"), in mail headers and before
  an ``<address@…>``, and as values of name-like keys (``owner: …``, ``name="…"``).
  Name words are capitalised Latin words (hyphens, apostrophes, particles such as van,
  de, da, bin) or words in scripts without case (Arabic, Devanagari, Han, Kana, Hangul);
- phone numbers in any national format (digits with the usual separators, 7-15 digits,
  not a date, time or IP), in place of Presidio's phonenumbers-based recognizer;
- card numbers of 12-19 digits that pass the Luhn check, however they are grouped;
- national ids: Presidio's recognizers for other countries registered for English text
  (UK NINO, Spanish NIF/NIE, Italian codice fiscale, PESEL, Turkish id, Aadhaar, Korean
  RRN) and checksum-validated patterns for the French NIR, Brazilian CPF, Dutch BSN and
  Chinese resident id.
"""

from __future__ import annotations

import regex
from presidio_analyzer import Pattern, PatternRecognizer

# -- names -------------------------------------------------------------------------------------
_UNCASED = r"\p{Arabic}\p{Devanagari}\p{Bengali}\p{Tamil}\p{Han}\p{Hiragana}\p{Katakana}\p{Hangul}\p{Thai}"
_CASED_WORD = r"(?:\p{Lu}\.|\p{Lu}[\p{L}\p{M}'’]*(?:-[\p{L}\p{M}'’]+)*)"  # a word or an initial
_UNCASED_WORD = rf"[{_UNCASED}][{_UNCASED}\p{{M}}]*"
_PARTICLE = r"(?:van|von|der|den|de|da|das|do|dos|del|della|di|du|la|le|bin|binti|ibn|al|el|ter|ten|y|e|St\.)"
_COMPANY = r"(?!(?:PLC|Plc|Inc|Ltd|LLC|GmbH|AG|BV|NV|SA|S\.A|SL|S\.L|Sp|SpA|Srl|Group|Şti|Corp|Co|KG|Oy|AB)\b)"
_WORD = rf"{_COMPANY}(?:{_CASED_WORD}|{_UNCASED_WORD}|(?:al|el)-\p{{Lu}}[\p{{L}}\p{{M}}'’]*)"
NAME = rf"{_WORD}(?:[ \t]+(?:{_PARTICLE}[ \t]+){{0,2}}{_WORD}){{0,3}}"

_UNCASED_NO_HAN = r"\p{Arabic}\p{Devanagari}\p{Bengali}\p{Tamil}\p{Hangul}\p{Thai}"
_FIRST = r"(?!(?:The|This|That|These|Our|Your|My|Mr|Mrs|Ms|Dr|Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)\b)"
FULL_NAME = rf"{_FIRST}{_CASED_WORD}(?:[ \t]+(?:{_PARTICLE}[ \t]+){{0,2}}{_COMPANY}{_CASED_WORD}){{1,3}}"
_BEFORE = (r"(?i:with|for|to|from|by|ask|asked|tell|told|met|meet|call|called|email|emailed|cc|thank|thanked"
           r"|invite|invited|and|of|about|contact|congratulate|introduce)")
_AFTER = (r"(?:will|would|can|could|is|was|has|had|said|says|asked|told|wrote|called|joined|sent|needs|wants"
          r"|thinks|replied|mentioned|and[ \t]+I)")
_INTRO = r"(?i:my[ \t]+name[ \t]+is|my[ \t]+name's|name[ \t]+is|i'm|i’m|i[ \t]+am|this[ \t]+is|it's|call[ \t]+me)"
_GREETING = r"(?i:hi|hello|hey|dear|good[ \t]+(?:morning|afternoon|evening))"
_SIGNOFF = (r"(?i:best|best[ \t]+regards|kind[ \t]+regards|warm[ \t]+regards|regards|thanks|thank[ \t]+you|cheers"
            r"|sincerely|yours|yours[ \t]+truly|many[ \t]+thanks|all[ \t]+the[ \t]+best|respectfully|love)")
_KEY = (r"(?i:name|full[_ ]?name|first[_ ]?name|last[_ ]?name|owner|customer|author|contact|user|client"
        r"|patient|employee|signed[ \t]+by|attn)")

NAME_PATTERNS: list[tuple[str, str, float]] = [
    ("name_intro", rf"(?<=\b{_INTRO}[ \t]+){NAME}", 0.85),
    ("name_greeting", rf"(?<=(?:^|[\s,.!])\b{_GREETING}[ \t,]+){NAME}(?=[ \t]*[,!:\n]|[ \t]+here\b)", 0.8),
    ("name_signoff", rf"(?<=^[ \t]*{_SIGNOFF}[ \t]*[,!.]?[ \t]*\n?[ \t]*){NAME}(?=[ \t]*(?:$|[|,\n]))", 0.85),
    ("name_sigdash", rf"(?<=^--[ \t]?\n[ \t]*){NAME}", 0.85),
    ("name_header", rf"(?<=^[ \t>]*(?i:from|to|cc|bcc|reply-to|sender):[ \t]*){NAME}", 0.85),
    ("name_before_address", rf"{NAME}(?=[ \t]*<[^<>@\s]+@[^<>\s]+>)", 0.85),
    ("name_key_value", rf"(?<=\b{_KEY}[\"']?[ \t]*[:=][ \t]*[\"']?){NAME}", 0.75),
    # a full name (two to four name words) after a word that often precedes a person ...
    ("name_after_word", rf"(?<=\b{_BEFORE}[ \t]+){FULL_NAME}", 0.6),
    # ... or before a verb a person does
    ("name_before_verb", rf"{FULL_NAME}(?=[ \t]+{_AFTER}\b)", 0.6),
    # two to four words in a script without case, inside otherwise Latin text
    ("name_uncased_run", rf"(?<![{_UNCASED}\p{{M}}])[{_UNCASED_NO_HAN}][{_UNCASED_NO_HAN}\p{{M}}]*"
                         rf"(?:[ \t]+[{_UNCASED_NO_HAN}][{_UNCASED_NO_HAN}\p{{M}}]*){{1,3}}", 0.5),
]

# Words a capitalised-word pattern may take for a name that are not names.
NOT_NAMES = frozenset("""
hi hello hey dear thanks thank cheers regards best sincerely yours the a an and or but this that it is i
please summarise summarize fix translate can could would will my our your his her their here there
""".split())


def name_recognizer() -> PatternRecognizer:
    return PatternRecognizer(
        supported_entity="PERSON", name="name_structure_recognizer", supported_language="en",
        patterns=[Pattern(n, rx, s) for n, rx, s in NAME_PATTERNS],
        global_regex_flags=regex.MULTILINE)  # case matters: a name word starts upper-case


# -- phones ------------------------------------------------------------------------------------
_PHONE = (r"(?<![\w+.\-/:#=])(?:\+|00)?[ \t]?\(?\d[\d \t().\-/]{5,22}\d"
          r"(?:[ \t]?(?i:x|ext\.?|#)[ \t]?\d{1,6})?(?![\w\-/:@]|[.,]\d)")
_NOT_PHONE = [regex.compile(p) for p in (
    r"^\d{4}-\d{2}-\d{2}", r"^\d{1,2}[./-]\d{1,2}[./-]\d{2,4}$", r"^\d{1,3}(?:\.\d{1,3}){3}$",
    r"^\d{1,2}:\d{2}", r"^\d+\.\d+$")]


def plausible_phone(text: str, start: int, end: int) -> bool:
    """Whether a phone finding (of any recognizer) can be one: 7-15 digits, not a date, a
    time, an IP or the fraction of a timestamp (phonenumbers' lenient matching takes those)."""
    main = regex.split(r"(?i)\s?(?:x|ext\.?|#)\s?\d+$", text[start:end].strip())[0]
    digits = regex.sub(r"\D", "", main)
    if start > 0 and text[start - 1] in ":.":
        return False
    return 7 <= len(digits) <= 15 and not any(p.search(main) for p in _NOT_PHONE)


class PhonePatternRecognizer(PatternRecognizer):
    """Numbers written the way people write phone numbers, anywhere in the world."""

    def __init__(self):
        super().__init__(supported_entity="PHONE_NUMBER", name="phone_pattern_recognizer", supported_language="en",
                         patterns=[Pattern("phone_any", _PHONE, 0.5)],
                         context=["phone", "tel", "call", "mobile", "cell", "sms", "whatsapp", "fax"],
                         global_regex_flags=regex.MULTILINE)

    def validate_result(self, pattern_text: str) -> bool | None:
        return None if plausible_phone(pattern_text, 0, len(pattern_text)) else False


# -- cards -------------------------------------------------------------------------------------
def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


class LuhnCardRecognizer(PatternRecognizer):
    """12-19 digits, grouped by spaces or dashes or not at all, that pass the Luhn check."""

    def __init__(self):
        super().__init__(supported_entity="CREDIT_CARD", name="luhn_card_recognizer", supported_language="en",
                         patterns=[Pattern("card_luhn", r"(?<![\w+.\-])\d(?:[ \-]?\d){11,18}(?![\w.\-])", 0.6)],
                         context=["card", "credit", "debit", "visa", "mastercard", "amex", "maestro", "payment"],
                         global_regex_flags=regex.MULTILINE)

    def validate_result(self, pattern_text: str) -> bool | None:
        digits = regex.sub(r"\D", "", pattern_text)
        return True if 12 <= len(digits) <= 19 and luhn_ok(digits) else False


# -- national ids ------------------------------------------------------------------------------
def _nir_ok(s: str) -> bool:
    s = regex.sub(r"\s", "", s).upper()
    num = s[:13].replace("2A", "19").replace("2B", "18")
    return len(s) == 15 and num.isdigit() and 97 - int(num) % 97 == int(s[13:])


def _cpf_ok(s: str) -> bool:
    d = [int(c) for c in regex.sub(r"\D", "", s)]
    if len(d) != 11 or len(set(d)) == 1:
        return False
    for n in (9, 10):
        check = sum(d[i] * (n + 1 - i) for i in range(n)) * 10 % 11 % 10
        if check != d[n]:
            return False
    return True


def _bsn_ok(s: str) -> bool:
    d = [int(c) for c in s]
    return len(d) == 9 and (sum(d[i] * (9 - i) for i in range(8)) - d[8]) % 11 == 0


def _cn_id_ok(s: str) -> bool:
    s = s.upper()
    weights = [7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2]
    return len(s) == 18 and "10X98765432"[sum(int(c) * w for c, w in zip(s[:17], weights, strict=True)) % 11] == s[17]


class ChecksumIdRecognizer(PatternRecognizer):
    """A national id pattern whose matches must pass the id's checksum."""

    def __init__(self, entity: str, pattern: str, check, context: list[str], score: float = 0.6):
        super().__init__(supported_entity=entity, name=f"{entity.lower()}_recognizer", supported_language="en",
                         patterns=[Pattern(entity.lower(), pattern, score)], context=context,
                         global_regex_flags=regex.MULTILINE)
        self._check = check

    def validate_result(self, pattern_text: str) -> bool | None:
        return bool(self._check(pattern_text))


def national_id_recognizers() -> list[PatternRecognizer]:
    from presidio_analyzer.predefined_recognizers import (
        EsNieRecognizer,
        EsNifRecognizer,
        InAadhaarRecognizer,
        ItFiscalCodeRecognizer,
        KrRrnRecognizer,
        PlPeselRecognizer,
        TrNationalIdRecognizer,
        UkNinoRecognizer,
    )

    out = [cls(supported_language="en") for cls in (UkNinoRecognizer, EsNifRecognizer, EsNieRecognizer,
                                                   ItFiscalCodeRecognizer, PlPeselRecognizer,
                                                   TrNationalIdRecognizer, InAadhaarRecognizer, KrRrnRecognizer)]
    out += [
        # any prefix and suffix letter (Presidio's leaves out what HMRC never issues, such as
        # ZZ or a suffix past D, but people mistype and invent them too)
        PatternRecognizer(supported_entity="UK_NINO", name="uk_nino_loose_recognizer", supported_language="en",
                          patterns=[Pattern("nino_loose", r"\b[A-Z]{2}[ ]?\d{2}[ ]?\d{2}[ ]?\d{2}[ ]?[A-Z]\b", 0.4)],
                          context=["national insurance", "nino", "ni number"], global_regex_flags=regex.MULTILINE),
        ChecksumIdRecognizer("FR_NIR", r"\b[12][ ]?\d{2}[ ]?\d{2}[ ]?(?:\d{2}|2[AB])[ ]?\d{3}[ ]?\d{3}[ ]?\d{2}\b",
                             _nir_ok, ["sécurité sociale", "securite sociale", "nir", "insee"]),
        ChecksumIdRecognizer("BR_CPF", r"(?<![\d.])\d{3}\.?\d{3}\.?\d{3}-?\d{2}(?!\d|\.\d)", _cpf_ok, ["cpf"]),
        ChecksumIdRecognizer("NL_BSN", r"(?<![\d.\-])\d{9}(?![\d\-]|\.\d)", _bsn_ok, ["bsn", "burgerservicenummer"],
                             score=0.5),
        ChecksumIdRecognizer("CN_RESIDENT_ID", r"(?<!\d)\d{17}[\dXx](?![\dXx])", _cn_id_ok,
                             ["身份证", "resident id", "id card"]),
    ]
    return out


NATIONAL_ID_ENTITIES: tuple[str, ...] = (
    "US_SSN", "US_ITIN", "US_PASSPORT", "UK_NHS", "UK_NINO", "ES_NIF", "ES_NIE", "IT_FISCAL_CODE", "PL_PESEL",
    "TR_NATIONAL_ID", "IN_AADHAAR", "KR_RRN", "FR_NIR", "BR_CPF", "NL_BSN", "CN_RESIDENT_ID")


def phone_recognizers() -> list:
    """The pattern above, in place of Presidio's phonenumbers-based recognizer: that one
    parses the text once per region (45 ms per 1,300 characters for 23 regions here) and
    found nothing the pattern missed in ``adaflash bench pii``."""
    return [PhonePatternRecognizer()]
