"""Fixtures of the stack tests: a tiny target that shares the real tokenizer, a drafter
bundle for it, and helpers to run ``adaflash`` commands against a private state dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 8


@pytest.fixture(scope="session")
def tiny_vocab_target(tmp_path_factory, real_target_dir) -> Path:
    """A 2-layer random target with the real vocabulary, tokenizer and chat template."""
    from tests.tiny_models import save_tiny

    d = save_tiny(tmp_path_factory.mktemp("tiny-vocab"), vocab=49152, hidden=32, layers=2, heads=2, kv_heads=1)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
              "generation_config.json"):
        src = real_target_dir / f
        if src.exists() and not (d / f).exists():
            (d / f).write_bytes(src.read_bytes())
    return d


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory, tiny_vocab_target) -> Path:
    """A random drafter bundle (version v0) for the tiny target."""
    from dataplane.drafter import new_drafter
    from dataplane.drafter_io import save_bundle
    from dataplane.model import TargetModel
    from dataplane.target_cache import target_identity

    target = TargetModel.from_pretrained(tiny_vocab_target)
    out = tmp_path_factory.mktemp("drafter") / "v0"
    save_bundle(new_drafter(target, seed=1, num_layers=1, n_target_layers=2, block_size=BLOCK), out,
                target_identity(tiny_vocab_target), version="v0")
    return out


def tiny_env(home: Path, target: Path, bundle: Path | None, **extra: str) -> dict[str, str]:
    """Environment for ``adaflash`` children: private home, tiny model, quick reconciling."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAFLASH_")}
    env.update({
        "ADAFLASH_HOME": str(home),
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "ADAFLASH_MODEL__PATH": str(target),
        "ADAFLASH_MODEL__MAX_MODEL_LEN": "512",
        "ADAFLASH_MODEL__TORCH_THREADS": "1",
        "ADAFLASH_DATAPLANE__BLOCK_SIZE": str(BLOCK),
        "ADAFLASH_DATAPLANE__MAX_PROMPT_TOKENS": "440",
        "ADAFLASH_DATAPLANE__MAX_NEW_TOKENS_LIMIT": "64",
        "ADAFLASH_DATAPLANE__RECONCILE_INTERVAL_S": "1",
        "ADAFLASH_STACK__RESTART_BACKOFF_S": "0.5",
        "ADAFLASH_STACK__READY_TIMEOUT_S": "240",
        "ADAFLASH_STACK__STOP_TIMEOUT_S": "8",
        "ADAFLASH_STACK__PROBE_INTERVAL_S": "1",
        "ADAFLASH_TELEMETRY__METRICS_INTERVAL_S": "2",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS": "",
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "200",
    })
    if bundle is not None:
        env["ADAFLASH_DATAPLANE__DRAFTER"] = str(bundle)
    env.update(extra)
    return env


def loop_env(home: Path, target: Path, bundle: Path, policy: Path, **extra: str) -> dict[str, str]:
    """``tiny_env`` for a whole loop: the gate policy file ``policy``, quick control-plane passes,
    a learner that trains and publishes small steps soon; ``extra`` wins."""
    from dataplane.target_cache import target_identity

    loop = {"ADAFLASH_STACK__GATE_POLICY": str(policy), "ADAFLASH_CONTROLPLANE__WORKER_INTERVAL_S": "1",
            "ADAFLASH_CONTROLPLANE__SHADOW_INTERVAL_S": "3", "ADAFLASH_MODEL__TARGET_ID": target_identity(target)["id"],
            "ADAFLASH_LEARNER__BUFFER_SIZE": "16", "ADAFLASH_LEARNER__MAX_WAIT_S": "5",
            "ADAFLASH_LEARNER__ANCHORS_PER_RECORD": "2", "ADAFLASH_LEARNER__EPOCHS": "1",
            "ADAFLASH_LEARNER__PUBLISH_EVERY": "1", "ADAFLASH_LEARNER__MAX_RECORD_TOKENS": "400",
            "ADAFLASH_LEARNER__POLL_TIMEOUT_MS": "200", "ADAFLASH_GOVERNANCE__POLICY_TTL_S": "1"}
    return tiny_env(home, target, bundle, **{**loop, **extra})


def adaflash(env: dict, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "adaflash.cli", *args], env=env, cwd=str(ROOT), capture_output=True,
                       text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"adaflash {' '.join(args)} -> {r.returncode}\nstdout:\n{r.stdout[-3000:]}\n"
                             f"stderr:\n{r.stderr[-3000:]}")
    return r


def status(env: dict) -> dict:
    return json.loads(adaflash(env, "status", "--json", check=False).stdout)


def log_tails(home: Path, n: int = 40) -> str:
    out = []
    for p in sorted((home / "logs").glob("*.log")):
        lines = p.read_text(errors="replace").splitlines()[-n:]
        out.append(f"--- {p.name}\n" + "\n".join(lines))
    return "\n".join(out)
