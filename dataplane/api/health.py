"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from dataplane.api import deps
from dataplane.node import Node

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(node: Node = Depends(deps.node)):
    engine = node.engine
    alive = engine._thread is not None and engine._thread.is_alive()
    drafter_ok = engine.mode == "ar" or engine.drafter is not None
    ready = alive and drafter_ok
    body = {"ready": ready, "model": node.identity["id"], "drafter_version": engine.drafter_version,
            "mode": engine.mode, "engine_alive": alive,
            "dtype": node.runner.precision, "device": str(node.runner.device),
            "verify_kernels": "triton" if node.runner.triton_verify else "torch"}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(node: Node = Depends(deps.node)):
    payload = node.engine.metrics.render()
    if node.emitter is not None and getattr(node.emitter, "registry", None) is not None:
        payload += generate_latest(node.emitter.registry)
    return Response(payload, media_type="text/plain; version=0.0.4")
