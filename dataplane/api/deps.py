"""FastAPI dependencies of the serving app: the node, admin auth, tenant, request bodies."""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Callable

from fastapi import Request
from pydantic import BaseModel, ValidationError

from adaflash.contracts.serving import TENANT_HEADER, TENANT_PATTERN
from adaflash.contracts.tenancy import DEFAULT_TENANT
from dataplane.api.errors import ApiError, from_validation
from dataplane.node import Node


def node(request: Request) -> Node:
    """The serving node (engine handle, tokenizer, drafter state)."""
    return request.app.state.node


def require_admin(request: Request) -> None:
    """Bearer token of the admin endpoints (compared in constant time)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    expected = request.app.state.admin_token.encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
        raise ApiError(401, "missing or invalid bearer token", code="unauthorized", type_="authentication_error")


def tenant(request: Request) -> str:
    """Tenant of the request from ``X-Tenant-ID`` (default tenant when absent)."""
    value = request.headers.get(TENANT_HEADER, DEFAULT_TENANT).strip() or DEFAULT_TENANT
    if not re.fullmatch(TENANT_PATTERN, value):
        raise ApiError(400, f"{TENANT_HEADER} must be 1-128 characters of letters, digits, '.', '_' or '-'",
                       param=TENANT_HEADER, code="invalid_tenant")
    return value


async def json_object(request: Request) -> dict:
    """The request body as a JSON object: 413 when too large, 400 when not a JSON object."""
    limit = request.app.state.node.settings.dataplane.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    raw = await request.body()
    if len(raw) > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    if not raw:
        raise ApiError(400, "request body is empty; send a JSON object", code="malformed_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="malformed_json") from e
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="malformed_json")
    return body


def body_of(model: type[BaseModel]) -> Callable:
    """A dependency that parses the body into ``model`` (first problem as a 400)."""

    async def parse(request: Request) -> BaseModel:
        body = await json_object(request)
        try:
            return model.model_validate(body)
        except ValidationError as e:
            raise from_validation(e) from e

    return parse


BODY_SCHEMAS: dict[str, dict] = {}  # nested models of hand-parsed bodies, for components/schemas


def openapi_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` documenting a body that ``body_of`` parses by hand."""
    schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
    BODY_SCHEMAS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
