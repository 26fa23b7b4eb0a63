"""A serving node: target, tokenizer, drafter, engine, feedback and hot-reload in one object.

The HTTP server (``dataplane.server``) is a thin layer over this. Drafter loads happen
off the engine thread (download, checks, build); only the final pointer swap happens
between two engine steps, so serving pauses for microseconds, not for the load.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path

from adaflash.config import Settings
from adaflash.contracts.feedback import FeedbackRecord
from adaflash.contracts.manifest import Manifest, sha256_file
from dataplane.drafter import Drafter, new_drafter
from dataplane.drafter_io import MANIFEST, DrafterLoadError, load_bundle, save_bundle
from dataplane.engine import Engine
from dataplane.envelope import RequestEnvelope
from dataplane.feedback import FeedbackBuilder, FinishedRequest, build_record
from dataplane.model import TargetModel
from dataplane.runner import ModelRunner, apply_cpu_settings
from dataplane.sequence import Sequence
from dataplane.target_cache import ensure_target, target_identity
from dataplane.tokenizer import Detokenizer, Tokenizer

log = logging.getLogger("adaflash.node")

STARTER_DIR = Path(__file__).parent / "starter"
RANDOM_VERSION = "random-0"


class Node:
    def __init__(self, settings: Settings, target: TargetModel | None = None, tokenizer: Tokenizer | None = None,
                 target_dir: Path | None = None):
        self.settings = settings
        cfg = settings.dataplane
        apply_cpu_settings(settings)
        self.target_dir = target_dir or ensure_target(settings)
        self.identity = target_identity(self.target_dir)
        # Device and precision of target and drafter (a drafter is placed like its target).
        self.runner = ModelRunner.of(target) if target is not None else ModelRunner.serving(settings)
        self.target = target or self.runner.load_target(self.target_dir)
        if target is None:  # kernels built, weights laid out: before ready, not in the first request
            log.info("serving forward warmed up in %.2f s", self.target.warm_up())
        self.tokenizer = tokenizer or Tokenizer(self.target_dir)
        self.node_id = cfg.node_id or f"{socket.gethostname()}-{cfg.port}"
        self.manifest: Manifest | None = None
        self.manifest_sha256: str | None = None
        self.drafter_source: str | None = None
        drafter, version = self._initial_drafter()
        self.engine = Engine(self.target, cfg, drafter=drafter, drafter_version=version,
                             eos_token_ids=[self.tokenizer.eos_token_id], max_model_len=settings.model.max_model_len)
        self.engine.on_finish = self.on_request_finished
        self.emitter = None  # set by the server when feedback is enabled
        self.feedback = FeedbackBuilder(self.feedback_record, self._emit)  # records built off the engine thread
        self.load_lock = threading.Lock()
        self.last_load_error: str | None = None
        self.loaded_at = time.time()
        self.started_at = time.time()

    # --- drafter ---------------------------------------------------------------------------------
    def _initial_drafter(self) -> tuple[Drafter | None, str | None]:
        src = self.settings.dataplane.drafter
        if self.settings.dataplane.mode == "ar" and not src:
            return None, None
        path = Path(src) if src else STARTER_DIR
        if (path / MANIFEST).is_file():
            drafter, manifest = load_bundle(path, self.target, self.identity)
            self._set_manifest(manifest, path)
            return drafter, manifest.version
        if src:
            raise DrafterLoadError(f"drafter directory {path} holds no {MANIFEST}")
        log.warning("no starter drafter at %s: serving with a random drafter", path)
        drafter = new_drafter(self.target, seed=0, block_size=self.settings.dataplane.block_size)
        return drafter, RANDOM_VERSION

    def _set_manifest(self, manifest: Manifest, path: Path) -> None:
        self.manifest = manifest
        self.manifest_sha256 = sha256_file(path / MANIFEST)
        self.drafter_source = str(path)

    def drafter_info(self) -> dict:
        m = self.manifest
        return {
            "version": self.engine.drafter_version,
            "mode": self.engine.mode,
            "source": self.drafter_source,
            "manifest_sha256": self.manifest_sha256,
            "block_size": m.block_size if m else self.settings.dataplane.block_size,
            "target": self.identity,
            "lineage": m.lineage.model_dump(mode="json") if m else None,
            "loaded_at": self.loaded_at,
            "last_load_error": self.last_load_error,
        }

    def load_drafter(self, version: str, uri: str, sha256: str | None = None, timeout: float = 60.0) -> dict:
        """Fetch, check and hot-swap a drafter. Raises DrafterLoadError; the old one keeps serving."""
        with self.load_lock:
            try:
                local = self._fetch(uri, version)
                drafter, manifest = load_bundle(local, self.target, self.identity, expected_sha256=sha256)
                if manifest.block_size != self.settings.dataplane.block_size:
                    raise DrafterLoadError(f"block size {manifest.block_size} differs from the node's "
                                           f"{self.settings.dataplane.block_size}")
            except (DrafterLoadError, OSError, ValueError) as e:  # a bad load is refused, never a crash
                err = e if isinstance(e, DrafterLoadError) else DrafterLoadError(f"{type(e).__name__}: {e}")
                self.last_load_error = str(err)
                self.engine.metrics.swaps.labels(result="refused").inc()
                raise err from e
            pause = self.engine.swap_drafter(drafter, version).result(timeout=timeout)
            self._set_manifest(manifest, local)
            self.loaded_at = time.time()
            self.last_load_error = None
            self.engine.metrics.swaps.labels(result="ok").inc()
            return {"version": version, "pause_ms": pause * 1000.0, "manifest_sha256": self.manifest_sha256}

    def _fetch(self, uri: str, version: str) -> Path:
        """A local directory for ``uri``: a path, file://, or an MLflow artifact URI."""
        if uri.startswith("file://"):
            return Path(uri[len("file://"):])
        if "://" not in uri and ":/" not in uri:
            return Path(uri)
        if uri.startswith(("http://", "https://")):
            _probe_http(uri)
        dest = self.settings.home / "drafters" / f"{version}-{secrets.token_hex(4)}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
            import mlflow

            tracking = self.settings.controlplane.mlflow_tracking_uri
            if tracking:
                mlflow.set_tracking_uri(tracking)
            got = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dest))
        except Exception as e:  # any fetch failure is a refused load, never a crash
            shutil.rmtree(dest, ignore_errors=True)
            if uri.startswith(("http://", "https://")):
                raise DrafterLoadError(f"cannot fetch {uri}: the server answers but serves no MLflow artifact "
                                       "directory there (use an mlflow-artifacts:/, models:/ or runs:/ URI, "
                                       "or a path on this node)") from e
            raise DrafterLoadError(f"cannot fetch {uri}: {type(e).__name__}: {e}") from e
        return Path(got)

    def save_current_drafter(self, directory: Path) -> None:
        """Write the serving drafter as a bundle (used to seed registries with the starter)."""
        if self.engine.drafter is None:
            raise DrafterLoadError("this node serves no drafter")
        save_bundle(self.engine.drafter, directory, self.identity, version=self.engine.drafter_version or "0")

    # --- requests ----------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids of a prompt as sent (chat prompts arrive already templated)."""
        return self.tokenizer.encode(prompt)

    def new_detokenizer(self, stop: list[str]) -> Detokenizer:
        return Detokenizer(self.tokenizer, stop)

    def on_request_finished(self, seq: Sequence, envelope: RequestEnvelope | None) -> None:
        """Engine thread: copy what the record needs and queue it (built in ``dataplane.feedback``)."""
        if self.emitter is None or seq.finish_reason == "cancelled" and not seq.output_ids:
            return
        self.feedback.submit(FinishedRequest.of(seq, envelope))

    def feedback_record(self, done: FinishedRequest) -> FeedbackRecord:
        """The raw (unscrubbed) record of a finished request; the emitter scrubs it."""
        return build_record(done, self.tokenizer, self.node_id, self.identity, self.engine.mode)

    def _emit(self, record: FeedbackRecord, traceparent: str | None) -> None:
        if self.emitter is not None:
            self.emitter.submit(record, traceparent=traceparent)

    def close_feedback(self, timeout: float = 30.0) -> bool:
        """Hand every queued record to the emitter and close it (shutdown)."""
        done = self.feedback.close(timeout)
        if self.emitter is not None:
            done = self.emitter.close(timeout) and done
        return done

    def live_status(self) -> dict:
        live = self.engine.metrics.live()
        done = max(1, self.engine.finished_count)
        return {"node_id": self.node_id, "version": self.engine.drafter_version, "mode": self.engine.mode,
                "tau": live["tau"], "tps": live["tps"], "error_rate": min(1.0, self.engine.error_count / done),
                "cost_curve": self.engine.cost.snapshot().model_dump(mode="json"), **self.engine.load}


def _probe_http(uri: str, timeout: float = 5.0) -> None:
    """Refuse an http(s) drafter URI whose server cannot be reached, naming why."""
    import httpx

    try:
        httpx.head(uri, timeout=timeout, follow_redirects=True)
    except httpx.HTTPError as e:
        raise DrafterLoadError(f"cannot fetch {uri}: the server is unreachable ({type(e).__name__}: {e})") from e
