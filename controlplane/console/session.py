"""The console's session: an encrypted, signed, HTTP-only cookie holding the API key and a CSRF token.

The browser never sees the key (the cookie is Fernet-encrypted with the console secret,
and HTTP-only, so no script reads it; nothing goes to localStorage). Every request
authenticates the key exactly as the API does (``controlplane.auth.authenticate``), so a
revoked or expired key ends the session at once. Form posts carry the session's CSRF
token; a post whose token does not match, or whose Origin is another site, is refused.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from cryptography.fernet import Fernet, InvalidToken
from fastapi import Request
from starlette.responses import Response

from adaflash import credentials
from adaflash.config import ControlplaneConfig
from controlplane.auth import Principal, authenticate
from controlplane.errors import ControlPlaneError, Forbidden

log = logging.getLogger("adaflash.controlplane.console")
COOKIE = "adaflash_console"
COOKIE_PATH = "/console"


@dataclass
class ConsoleSession:
    csrf: str
    key: str | None = None  # the API key the user logged in with
    principal: Principal | None = None  # set when the key still authenticates


class SessionCodec:
    """Encrypts and decrypts session cookies with the console secret."""

    def __init__(self, cfg: ControlplaneConfig, jwt_secret: str | None):
        secret = credentials.lookup(credentials.console_secret(cfg)) or ""
        if not secret:
            if jwt_secret:
                secret = "console:" + jwt_secret
            else:
                log.warning("$%s is not set: console sessions use a per-process secret and end on restart",
                            cfg.console_secret_env)
                secret = secrets.token_hex(32)
        self.fernet = Fernet(base64.urlsafe_b64encode(hashlib.sha256(secret.encode()).digest()))
        self.max_age_s = int(cfg.console_session_s)

    def encode(self, s: ConsoleSession) -> str:
        return self.fernet.encrypt(json.dumps({"csrf": s.csrf, "key": s.key}).encode()).decode()

    def decode(self, value: str | None) -> ConsoleSession | None:
        if not value:
            return None
        try:
            data = json.loads(self.fernet.decrypt(value.encode(), ttl=self.max_age_s))
        except (InvalidToken, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("csrf"), str):
            return None
        key = data.get("key")
        return ConsoleSession(csrf=data["csrf"], key=key if isinstance(key, str) else None)


def load(request: Request) -> ConsoleSession:
    """The caller's session (a fresh anonymous one if the cookie is missing or bad), authenticated."""
    app = request.app
    s = app.state.console_codec.decode(request.cookies.get(COOKIE)) or ConsoleSession(csrf=secrets.token_hex(16))
    if s.key:
        with app.state.sessions() as db:
            try:
                s.principal = authenticate(db, s.key, app.state.settings.controlplane, app.state.jwt_secret)
            except ControlPlaneError:
                s.key = None  # revoked or expired: the session is anonymous again
    return s


def _https(request: Request) -> bool:
    """Served over TLS, here or at the proxy in front (an Ingress terminating TLS says so)."""
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def save(request: Request, response: Response, s: ConsoleSession) -> Response:
    response.set_cookie(COOKIE, request.app.state.console_codec.encode(s), max_age=int(
        request.app.state.console_codec.max_age_s), path=COOKIE_PATH, httponly=True, samesite="strict",
        secure=_https(request))
    return response


def check_csrf(request: Request, s: ConsoleSession, token: str | None) -> None:
    """A form post must carry the session's token and, if the browser says where it came from, come
    from this host (the scheme is not compared: a proxy may terminate TLS in front of us)."""
    origin = request.headers.get("origin")
    if origin and origin != "null" and urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower():
        raise Forbidden(f"cross-site form post from {origin} refused")
    if not token or not hmac.compare_digest(token, s.csrf):
        raise Forbidden("missing or wrong CSRF token: reload the page and try again")
