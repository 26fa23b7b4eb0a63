"""The node's HTTP server; the app is built from routers in ``dataplane.api``."""

from dataplane.api import create_app

__all__ = ["create_app"]
