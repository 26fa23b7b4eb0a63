"""The approver's console: server-rendered pages at /console over the admin API's own code.

Pages call the API's route functions with the logged-in key's principal after the same
role check the API applies (``controlplane.api.deps.allow`` with the API's role sets),
so every action takes the API's path, validation and audit. Templates (Jinja2) and a
little CSS/JS ship in this package; nothing is fetched from elsewhere at run time.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from controlplane.console.session import SessionCodec

HERE = Path(__file__).resolve().parent


def install(app: FastAPI) -> None:
    """Mount the console on the control plane's app (after ``app.state`` is set up)."""
    from controlplane.console import actions, pages

    app.state.console_codec = SessionCodec(app.state.settings.controlplane, app.state.jwt_secret)
    app.state.console_templates = Jinja2Templates(directory=str(HERE / "templates"))
    app.mount("/console/static", StaticFiles(directory=str(HERE / "static")), name="console-static")
    app.include_router(pages.router)
    app.include_router(actions.router)
