"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Bad input is a 4xx naming the problem; a 500 is only ever our own failure, and its
message carries no internals.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaflash.contracts.serving import error_body

log = logging.getLogger("adaflash.server")

_HTTP_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def from_validation(e: ValidationError | RequestValidationError) -> ApiError:
    """The first problem of a pydantic validation, as a 400 naming the field."""
    errs = e.errors()
    err = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
    if err.get("type") == "json_invalid":
        return ApiError(400, "request body is not valid JSON", code="malformed_json")
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"{loc or 'body'}: {msg}", param=loc or None, code="invalid_value")


def install(app: FastAPI, on_reject=None) -> None:
    """Exception handlers of the serving app; ``on_reject(code)`` counts refused requests."""

    def reply(e: ApiError) -> JSONResponse:
        if on_reject is not None:
            on_reject(e.code or str(e.status))
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError):
        return reply(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError):
        return reply(from_validation(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, e: StarletteHTTPException):
        detail = str(e.detail)
        if e.status_code == 404:
            detail = f"no route {req.method} {req.url.path}"
        elif e.status_code == 405:
            detail = f"method {req.method} is not allowed on {req.url.path}"
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(e.status_code)
        return reply(ApiError(e.status_code, detail, code=code,
                              type_=_HTTP_TYPES.get(e.status_code, "invalid_request_error")))

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body("internal error", type_="server_error"), status_code=500)
