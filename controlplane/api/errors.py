"""Every error leaves the API as JSON: {"error": code, "message": text, "details": [...]}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from starlette.exceptions import HTTPException as StarletteHTTPException

from controlplane.errors import ControlPlaneError

log = logging.getLogger("adaflash.controlplane")

_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
          409: "conflict", 413: "too_large", 415: "unsupported_media_type", 422: "validation_error"}


def error_response(status: int, message: str, details: list | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": code or _CODES.get(status, "error"), "message": message}
    if details:
        body["details"] = details
    return JSONResponse(body, status_code=status, headers=headers)


def _details(errors) -> list[dict]:
    out = []
    for e in errors:
        out.append({"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")),
                    "type": str(e.get("type", ""))})
    return out


def install(app: FastAPI) -> None:
    @app.exception_handler(ControlPlaneError)
    async def _domain(_: Request, exc: ControlPlaneError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.message, code=exc.code, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        bad_json = [e for e in errors if e.get("type") == "json_invalid"]
        if bad_json:
            ctx = bad_json[0].get("ctx") or {}
            return error_response(400, f"malformed JSON body: {ctx.get('error', 'cannot be parsed')}",
                                  code="malformed_json")
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(422, f"invalid request: {where}: {first.get('msg', 'invalid')}",
                              details=_details(errors))

    @app.exception_handler(ValidationError)
    async def _pydantic(_: Request, exc: ValidationError):
        return error_response(422, f"invalid data: {exc.errors()[0]['msg']}", details=_details(exc.errors()))

    @app.exception_handler(IntegrityError)
    async def _integrity(_: Request, exc: IntegrityError):
        log.warning("integrity error: %s", exc.orig)
        return error_response(409, "the change conflicts with stored data", code="conflict")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"error": "internal", "message": "internal error; see the control plane log"},
                            status_code=500)
