"""What a user would run instead, at the same precision: transformers and llama.cpp.

Both decode greedily at batch 1 on the same prompts and the same number of new tokens,
prefill included, like our ``ar`` at concurrency 1. llama.cpp is optional (the
``llama-cpp-python`` package, built from its source distribution, and a GGUF of the
target in the served precision made with llama.cpp's ``convert_hf_to_gguf.py`` from the
converted target directory); without it the figure is reported as absent.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch


def transformers_tps(target_dir: Path, prompt_ids: list[list[int]], max_tokens: int, dtype: torch.dtype,
                     eos: int = 2) -> float:
    """Tokens/s of transformers ``generate`` (greedy, batch 1), first prompt as a warm-up."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    with torch.no_grad():
        hf.generate(torch.tensor([prompt_ids[0]]), max_new_tokens=4, do_sample=False, pad_token_id=eos)
        tokens, t0 = 0, time.perf_counter()
        for ids in prompt_ids:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=eos)
            tokens += out.shape[1] - len(ids)
    return tokens / (time.perf_counter() - t0)


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_tps(gguf: Path, prompt_ids: list[list[int]], max_tokens: int, threads: int) -> float:
    """Tokens/s of llama.cpp on ``gguf`` (greedy, batch 1, our prompt token ids)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)

    def generate(ids: list[int], n: int) -> int:
        llm.reset()
        got = 0
        for _tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            got += 1
            if got >= n:
                break
        return got

    generate(prompt_ids[0], 4)
    tokens, t0 = 0, time.perf_counter()
    for ids in prompt_ids:
        tokens += generate(ids, max_tokens)
    return tokens / (time.perf_counter() - t0)
