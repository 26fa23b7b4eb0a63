"""A labelled, seeded corpus of synthetic PII for ``adaflash bench pii``.

Each record is one text a user could send (or a model could answer) with every planted
value labelled: person names, emails, phone numbers, card numbers, national ids,
addresses, secrets (and IPs/IBANs, labelled so they do not count against precision).
Values come from Faker in many locales (names in their own script for hi_IN and Arabic,
romanised for ja_JP and zh_CN, hyphenated double surnames in a share of records); the
texts are introductions, signatures, quoted e-mails, code and config files, logs, plain
mentions and addresses. Nothing here is real: ShareGPT is not used.

``generate(n, seed)`` is deterministic for a given Faker version.
"""

from __future__ import annotations

import base64
import json
import random
import string
from dataclasses import dataclass, field
from datetime import datetime

from faker import Faker

# locale -> how names are made ("latin": first/last; "romanized": Faker's romanised names;
# "native": Faker's names in their own script)
LOCALES: dict[str, str] = {
    "en_US": "latin", "en_GB": "latin", "de_DE": "latin", "fr_FR": "latin", "es_ES": "latin", "it_IT": "latin",
    "pt_BR": "latin", "nl_NL": "latin", "pl_PL": "latin", "tr_TR": "latin", "ja_JP": "romanized",
    "zh_CN": "romanized", "hi_IN": "native", "en_IN": "latin", "ar_AA": "native", "sw": "latin",
    "yo_NG": "latin", "zu_ZA": "latin", "en_NG": "latin", "vi_VN": "latin",
}
REQUIRED = ("person", "email", "phone", "card", "national_id", "secret")
TYPES = REQUIRED + ("address", "other")


@dataclass
class Span:
    type: str
    value: str
    start: int
    end: int
    kind: str = ""  # finer kind (ssn, nino, aws_key_id, ...)


@dataclass
class Record:
    id: int
    locale: str
    placement: str
    text: str
    spans: list[Span] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"id": self.id, "locale": self.locale, "placement": self.placement, "text": self.text,
                "spans": [s.__dict__ for s in self.spans]}


class _Builder:
    """Concatenates literal text and labelled values, keeping offsets."""

    def __init__(self):
        self.parts: list[str] = []
        self.spans: list[Span] = []
        self.n = 0

    def lit(self, s: str) -> _Builder:
        self.parts.append(s)
        self.n += len(s)
        return self

    def val(self, type_: str, value: str, kind: str = "") -> _Builder:
        self.spans.append(Span(type_, value, self.n, self.n + len(value), kind))
        return self.lit(value)

    def text(self) -> str:
        return "".join(self.parts)


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class Values:
    """Draws labelled values for one locale from Faker and a seeded RNG."""

    def __init__(self, locale: str, rng: random.Random, fake: Faker):
        self.locale, self.rng, self.f = locale, rng, fake

    # -- people ------------------------------------------------------------------------
    def person(self) -> str:
        style, f = LOCALES[self.locale], self.f
        if style == "romanized":
            return f"{f.first_romanized_name()} {f.last_romanized_name()}"
        if style == "native":
            return f"{f.first_name()} {f.last_name()}"
        last = f.last_name()
        r = self.rng.random()
        if r < 0.25 and "-" not in last:
            last = f"{last}-{f.last_name()}"
        first = f.first_name()
        if r > 0.85:
            first = f"{first} {f.first_name()}"
        return f"{first} {last}"

    def first_name(self, full: str) -> str:
        return full.split()[0]

    def email(self, name: str | None = None) -> str:
        return self.rng.choice([self.f.free_email, self.f.company_email, self.f.email])()

    def phone(self) -> str:
        return self.f.phone_number()

    def card(self) -> str:
        num = self.f.credit_card_number()
        r = self.rng.random()
        if r < 0.3 and len(num) == 16:
            return " ".join(num[i:i + 4] for i in range(0, 16, 4))
        if r < 0.45 and len(num) == 16:
            return "-".join(num[i:i + 4] for i in range(0, 16, 4))
        return num

    def national_id(self) -> tuple[str, str, str]:
        """(value, kind, how a person would name it)."""
        f, loc = self.f, self.locale
        table = {
            "en_US": lambda: (f.ssn(), "us_ssn", "SSN"),
            "en_GB": lambda: (f.ssn(), "uk_nino", "National Insurance number"),
            "fr_FR": lambda: (f.ssn(), "fr_nir", "numéro de sécurité sociale"),
            "es_ES": lambda: self.rng.choice([(f.nif(), "es_nif", "DNI"), (f.nie(), "es_nie", "NIE")]),
            "it_IT": lambda: (f.ssn(), "it_fiscal_code", "codice fiscale"),
            "pt_BR": lambda: (f.cpf(), "br_cpf", "CPF"),
            "nl_NL": lambda: (f.ssn(), "nl_bsn", "BSN"),
            "pl_PL": lambda: (f.pesel(), "pl_pesel", "PESEL"),
            "tr_TR": lambda: (f.ssn(), "tr_tckn", "TC kimlik no"),
            "en_IN": lambda: (f.aadhaar_id(), "in_aadhaar", "Aadhaar"),
            "zh_CN": lambda: (f.ssn(), "cn_resident_id", "resident ID"),
        }
        if loc in table:
            return table[loc]()
        us = Faker("en_US")
        us.seed_instance(self.rng.getrandbits(32))
        return us.ssn(), "us_ssn", "SSN"

    def address(self) -> str:
        return self.f.address()

    def when(self) -> datetime:
        """A moment in a fixed window (Faker's defaults end at 'now', which is not reproducible)."""
        return self.f.date_time_between(start_date=datetime(2019, 1, 1), end_date=datetime(2025, 12, 31))

    # -- secrets -----------------------------------------------------------------------
    def _chars(self, alphabet: str, n: int) -> str:
        return "".join(self.rng.choice(alphabet) for _ in range(n))

    def secret(self) -> tuple[str, str]:
        """(value, kind)."""
        an = string.ascii_letters + string.digits
        up = string.ascii_uppercase + string.digits
        kind = self.rng.choice(["aws_key_id", "aws_secret", "github_token", "github_pat", "pem_private_key",
                                "jwt", "openai_key", "anthropic_key", "slack_token", "stripe_key", "google_api_key"])
        if kind == "aws_key_id":
            return "AKIA" + self._chars(up, 16), kind
        if kind == "aws_secret":
            return self._chars(an + "/+", 39) + self.rng.choice(string.digits), kind
        if kind == "github_token":
            return self.rng.choice(["ghp_", "gho_", "ghs_"]) + self._chars(an, 36), kind
        if kind == "github_pat":
            return "github_pat_" + self._chars(an, 22) + "_" + self._chars(an, 59), kind
        if kind == "pem_private_key":
            body = base64.b64encode(self.rng.randbytes(480)).decode()
            lines = "\n".join(body[i:i + 64] for i in range(0, len(body), 64))
            label = self.rng.choice(["RSA PRIVATE KEY", "PRIVATE KEY", "EC PRIVATE KEY", "OPENSSH PRIVATE KEY"])
            return f"-----BEGIN {label}-----\n{lines}\n-----END {label}-----", kind
        if kind == "jwt":
            head = _b64url(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
            body = _b64url(json.dumps({"sub": self.f.user_name(), "iat": self.rng.randint(1.6e9, 1.8e9)}).encode())
            return f"{head}.{body}.{_b64url(self.rng.randbytes(32))}", kind
        if kind == "openai_key":
            return "sk-proj-" + self._chars(an + "_-", 48), kind
        if kind == "anthropic_key":
            return "sk-ant-api03-" + self._chars(an + "_-", 80), kind
        if kind == "slack_token":
            return f"xoxb-{self.rng.randint(10**10, 10**11)}-{self.rng.randint(10**10, 10**11)}-" + \
                self._chars(an, 24), kind
        if kind == "stripe_key":
            return self.rng.choice(["sk_live_", "rk_live_", "sk_test_"]) + self._chars(an, 24), kind
        return "AIza" + self._chars(an + "_-", 35), kind

    def password(self) -> str:
        return self.f.password(length=self.rng.randint(10, 18), special_chars=False)


# -- texts -------------------------------------------------------------------------------------
BODIES = ["Could you help me rewrite the paragraph below so it sounds friendlier?",
          "The invoice from last month still shows the wrong amount.",
          "I need a short summary of the attached meeting notes.",
          "My order has not arrived yet and the tracking page shows nothing.",
          "Please explain how to reset the router to factory settings."]
SIGNOFFS = ["Best,", "Best regards,", "Kind regards,", "Thanks,", "Thank you,", "Cheers,", "Sincerely,",
            "Regards,", "Many thanks,", "Warm regards,"]


def intro(v: Values, b: _Builder) -> None:
    p = v.person()
    c = v.rng.randrange(8)
    if c == 0:
        b.lit("Hi, my name is ").val("person", p).lit(f". {v.rng.choice(BODIES)}")
    elif c == 1:
        b.lit("Hello! I'm ").val("person", p).lit(" and I have a question about my account.")
    elif c == 2:
        b.lit("This is ").val("person", p).lit(f" from {v.f.company()}. {v.rng.choice(BODIES)}")
    elif c == 3:
        b.lit("My name's ").val("person", p).lit(", you can reach me at ").val("email", v.email()).lit(" or ")
        b.val("phone", v.phone()).lit(".")
    elif c == 4:
        b.lit("Hi, my name is ").val("person", p).lit(" and my card ").val("card", v.card(), "card")
        b.lit(" was charged twice.")
    elif c == 5:
        value, kind, label = v.national_id()
        b.lit("I am ").val("person", p).lit(f"; my {label} is ").val("national_id", value, kind).lit(".")
    elif c == 6:
        b.lit("Good morning, ").val("person", p).lit(" here. Please call me back on ").val("phone", v.phone())
        b.lit(".")
    else:
        b.lit("Hi there, I am ").val("person", p).lit(". I moved to ").val("address", v.address().replace("\n", ", "))
        b.lit(" last week.")


def signature(v: Values, b: _Builder) -> None:
    p = v.person()
    c = v.rng.randrange(5)
    b.lit(v.rng.choice(BODIES) + "\n\n")
    if c == 0:
        b.lit(v.rng.choice(SIGNOFFS) + "\n").val("person", p)
    elif c == 1:
        b.lit(v.rng.choice(SIGNOFFS) + "\n").val("person", p).lit("\n").val("phone", v.phone())
    elif c == 2:
        b.lit("-- \n").val("person", p).lit(f"\n{v.f.company()}\n").val("email", v.email())
    elif c == 3:
        b.lit(v.rng.choice(SIGNOFFS) + "\n").val("person", p).lit(" | ").val("phone", v.phone())
    else:
        b.lit(v.rng.choice(SIGNOFFS) + " ").val("person", p)


def quoted_email(v: Values, b: _Builder) -> None:
    p, q = v.person(), v.person()
    c = v.rng.randrange(3)
    if c == 0:
        b.lit(f"Can you draft a reply to this?\n\nOn {v.when().date().isoformat()}, ").val("person", p).lit(" <")
        b.val("email", v.email()).lit("> wrote:\n> " + v.rng.choice(BODIES) + "\n> Please call ")
        b.val("phone", v.phone()).lit(" if anything is unclear.")
    elif c == 1:
        b.lit("From: ").val("person", p).lit(" <").val("email", v.email()).lit(">\nTo: ").val("person", q)
        b.lit(" <").val("email", v.email()).lit(f">\nSubject: {v.f.catch_phrase()}\n\n{v.rng.choice(BODIES)}\n")
    else:
        b.lit("Summarise this thread:\n-----Original Message-----\nFrom: ").val("person", p)
        b.lit(f"\nSent: {v.when().date().isoformat()}\nTo: ").val("email", v.email()).lit("\n\nHi ").val("person", v.first_name(q))
        b.lit(", the payment with card ").val("card", v.card()).lit(" failed again.")


def code(v: Values, b: _Builder) -> None:
    c = v.rng.randrange(6)
    user, host = v.f.user_name(), v.f.domain_name()
    if c == 0:
        b.lit("Why does this .env not work?\n\nDATABASE_URL=postgres://" + user + ":").val("secret", v.password(),
                                                                                           "url_password")
        b.lit(f"@db.{host}:5432/app\nAWS_ACCESS_KEY_ID=")
        key, kind = v.secret()
        b.val("secret", key, kind).lit("\nDEBUG=true\n")
    elif c == 1:
        key, kind = v.secret()
        b.lit("config.yaml:\n\nowner: ").val("person", v.person()).lit("\ncontact: ").val("email", v.email())
        b.lit("\ncredentials:\n  token: ").val("secret", key, kind).lit("\n")
    elif c == 2:
        key, kind = v.secret()
        b.lit("Fix this Python:\n\nimport requests\nAPI_KEY = \"").val("secret", key, kind)
        b.lit("\"\nrequests.get('https://api." + host + "/v1/items', headers={'X-Api-Key': API_KEY})\n")
    elif c == 3:
        token = "ghp_" + v._chars(string.ascii_letters + string.digits, 36)
        b.lit(f"git remote add origin https://{user}:").val("secret", token, "github_token")
        b.lit(f"@github.com/{user}/tools.git\nfatal: Authentication failed")
    elif c == 4:
        key, kind = v.secret()
        b.lit("Here is my deploy key, what format is it?\n\n").val("secret", key, kind).lit("\n")
    else:
        b.lit(f"mongodb+srv://{user}:").val("secret", v.password(), "url_password")
        b.lit(f"@cluster0.{host}/test?retryWrites=true  <- the connection string from the console")


def log(v: Values, b: _Builder) -> None:
    ts = v.when().isoformat()
    c = v.rng.randrange(6)
    if c == 0:
        b.lit(f"{ts} INFO login ok user=").val("email", v.email()).lit(" ip=").val("other", v.f.ipv4(), "ip")
    elif c == 1:
        b.lit(f"{ts} WARN payment declined card=").val("card", v.card()).lit(" customer=\"").val("person", v.person())
        b.lit("\"")
    elif c == 2:
        b.lit(f"{ts} ERROR sms to ").val("phone", v.phone()).lit(" failed: gateway timeout (attempt 3)")
    elif c == 3:
        key, kind = v.secret()
        b.lit(f"{ts} DEBUG outgoing request headers: Authorization=Bearer ").val("secret", key, kind)
    elif c == 4:
        value, kind, label = v.national_id()
        b.lit(f"{ts} AUDIT kyc check passed {label.lower().replace(' ', '_')}=").val("national_id", value, kind)
        b.lit(" name=\"").val("person", v.person()).lit("\"")
    else:
        b.lit(f"Why does my job crash?\n{ts} INFO connecting as ").val("email", v.email())
        key, kind = v.secret()
        b.lit(f"\n{ts} ERROR auth failed for api_key=").val("secret", key, kind)


def mention(v: Values, b: _Builder) -> None:
    p = v.person()
    c = v.rng.randrange(5)
    if c == 0:
        b.lit("Can you write a short birthday message for ").val("person", p).lit("?")
    elif c == 1:
        b.lit("I spoke with ").val("person", p).lit(" yesterday and she said the order had shipped.")
    elif c == 2:
        b.lit("Please forward the contract to ").val("person", p).lit(" in accounting, thanks.")
    elif c == 3:
        b.lit("Translate to French: ").val("person", p).lit(" will join the call at 10.")
    else:
        value, kind, label = v.national_id()
        b.lit(f"Is this a valid {label}? ").val("national_id", value, kind)


def address(v: Values, b: _Builder) -> None:
    c = v.rng.randrange(3)
    if c == 0:
        b.lit("Please ship it to ").val("address", v.address().replace("\n", ", ")).lit(".")
    elif c == 1:
        b.lit("Invoice address:\n").val("address", v.address()).lit("\nIBAN: ").val("other", v.f.iban(), "iban")
    else:
        b.lit("My new address is ").val("address", v.address().replace("\n", ", ")).lit(", phone ")
        b.val("phone", v.phone()).lit(".")


PLACEMENTS = {"intro": (intro, 5), "signature": (signature, 3), "quoted_email": (quoted_email, 2), "code": (code, 3),
              "log": (log, 3), "mention": (mention, 2), "address": (address, 1)}


def generate(n: int = 2000, seed: int = 0) -> list[Record]:
    """``n`` labelled records, deterministic for ``seed`` (and the Faker version)."""
    rng = random.Random(seed)
    fakers: dict[str, Faker] = {}
    names = list(PLACEMENTS)
    weights = [PLACEMENTS[k][1] for k in names]
    out: list[Record] = []
    for i in range(n):
        loc = list(LOCALES)[i % len(LOCALES)]
        if loc not in fakers:
            fakers[loc] = Faker(loc)
        fake = fakers[loc]
        fake.seed_instance(rng.getrandbits(32))
        placement = rng.choices(names, weights)[0]
        b = _Builder()
        PLACEMENTS[placement][0](Values(loc, rng, fake), b)
        out.append(Record(i, loc, placement, b.text(), b.spans))
    return out
