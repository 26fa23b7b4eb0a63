"""Errors the control plane's actions raise; the API turns each into a JSON response."""

from __future__ import annotations


class ControlPlaneError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Unauthorized(ControlPlaneError):
    status = 401
    code = "unauthorized"


class Forbidden(ControlPlaneError):
    status = 403
    code = "forbidden"


class NotFound(ControlPlaneError):
    status = 404
    code = "not_found"


class Conflict(ControlPlaneError):
    """The action does not fit the current state (e.g. approving a rejected version)."""

    status = 409
    code = "conflict"


class Invalid(ControlPlaneError):
    """Well-formed but not acceptable (e.g. an auditor key without tenants)."""

    status = 422
    code = "validation_error"
