"""Admin endpoints (bearer token): the served drafter and hot loads."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from adaflash.contracts.serving import DrafterLoadRequest
from dataplane.api import deps
from dataplane.api.errors import ApiError
from dataplane.drafter_io import DrafterLoadError
from dataplane.node import Node

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(deps.require_admin)])


@router.get("/drafter")
async def get_drafter(node: Node = Depends(deps.node)):
    return node.drafter_info()


@router.post("/drafter", openapi_extra=deps.openapi_body(DrafterLoadRequest))
async def post_drafter(req: DrafterLoadRequest = Depends(deps.body_of(DrafterLoadRequest)),
                       node: Node = Depends(deps.node)):
    """Fetch, check and swap a drafter; a refused one leaves the old one serving (409)."""
    try:
        return await asyncio.to_thread(node.load_drafter, req.version, req.uri, req.sha256)
    except DrafterLoadError as e:
        raise ApiError(409, f"drafter refused, still serving {node.engine.drafter_version}: {e}",
                       param="uri", code="drafter_refused") from e


@router.get("/requests")
async def get_requests(request: Request, node: Node = Depends(deps.node)):
    """Completion requests in flight: stage, age, and where the engine holds each choice."""
    return {"node_id": node.node_id, "engine": node.engine.load, "engine_steps": node.engine.steps,
            "requests": request.app.state.inflight.snapshot()}
