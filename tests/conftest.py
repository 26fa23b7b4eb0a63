"""Shared fixtures: tiny random-weight models of the target's family, and the real target."""

from __future__ import annotations

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run in the interpreter on CPU so their tests compare them with the torch references.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny_models import save_tiny  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (4 layers, vocab 97) saved in Hugging Face format."""
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), model_type="llama")


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), model_type="qwen3")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    from dataplane.model import TargetModel

    return TargetModel.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def real_target_dir():
    """The real SmolLM2-135M-Instruct, converted once from the installed wheel."""
    from adaflash.config import load_config
    from dataplane.target_cache import ensure_target

    return ensure_target(load_config(), progress=False)


@pytest.fixture(scope="session")
def real_target(real_target_dir):
    from dataplane.model import TargetModel

    return TargetModel.from_pretrained(real_target_dir)


@pytest.fixture(scope="session")
def real_tokenizer(real_target_dir):
    from dataplane.tokenizer import Tokenizer

    return Tokenizer(real_target_dir)


def pytest_terminal_summary(terminalreporter) -> None:
    """The threads still alive at the end of the run that used the most CPU: a thread a test
    left running (an engine loop, a server, a consumer) slows every test after it."""
    from tests.thread_cpu import cpu_seconds, thread_name

    used = sorted(((cpu, tid) for tid, cpu in cpu_seconds().items()), reverse=True)
    terminalreporter.write_sep("-", f"{len(used)} threads alive at the end, by CPU seconds used")
    for cpu, tid in used[:12]:
        terminalreporter.write_line(f"{cpu:10.1f}  {thread_name(tid)}")
