"""Target-labelled training data for the offline drafter, resumable and cached.

Two kinds of sequences, both from the training split of ``promptsets`` only:

- ``tf`` (teacher-forced): real text (chat template with the ShareGPT human turn and
  its gpt answer; HumanEval prompt + canonical solution; synthetic math problem + its
  templated worked answer) run through the frozen target in one prefill. About 200
  tokens/s on one core.
- ``regen`` (on-policy): the target's own greedy answers to training prompts, generated
  with our engine (mode ``ar``, batched), then prefilled like ``tf``. Slower (about 50
  tokens/s on one core in float32, 400 on two cores of an AMX Xeon in bfloat16) but it is
  the distribution speculation sees at serving time.
- ``sample``: the target's sampled answers (temperature ``SAMPLE_TEMPERATURE``, a seed per
  answer) to the same training prompts, cycling over them ``passes`` times with new
  seeds: more on-policy text where prompts are few (HumanEval has 120 training tasks).
  Labelled with the target's top-1 like ``tf``, and trained like it: a block position
  counts only while the text agrees with the target's greedy choice.

Each shard stores, per token of a packed run of sequences: the token ids, the target's
top-1 next-token label and the hidden states of ``layers`` (float16), plus ``cu`` (sequence
boundaries) and ``resp_start`` (where each answer starts). Layout:

    <cache>/data/<target id>/<kind>-<domain>/shard-00000.safetensors (+ .json meta)
                                             gen-00000.jsonl   (regen: generated answers)

A shard that exists is never recomputed, so ``prepare`` resumes where it stopped and
the data accumulates across sessions.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import promptsets as ds

KINDS = ("regen", "tf", "sample")
SAMPLE_TEMPERATURE = 0.8
# Hidden states kept on disk: the drafter's default layers (1, 10, 18, 27 for 30 layers)
# plus the last layer, so drafters reading any subset can train on the same shards.
def store_layers(num_layers: int) -> tuple[int, ...]:
    from dataplane.model import default_hidden_layers

    return tuple(sorted(set(default_hidden_layers(num_layers, 4)) | {num_layers - 1}))


@dataclass
class StreamSpec:
    kind: str  # regen | tf | sample
    domain: str
    shard_size: int  # sequences per shard
    max_len: int  # tokens per sequence (prompt + answer), longer ones are cut
    max_new_tokens: int = 256  # regen and sample
    max_prompt_tokens: int = 320  # regen and sample: longer prompts are skipped
    passes: int = 1  # sample: times over the domain's training prompts, each with new seeds

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.domain}"


DEFAULT_STREAMS = (
    StreamSpec("regen", "math", 48, 512, max_new_tokens=192),
    StreamSpec("regen", "code", 40, 640, max_new_tokens=256),
    StreamSpec("tf", "chat", 48, 512),
    StreamSpec("regen", "chat", 48, 576, max_new_tokens=224),
    StreamSpec("tf", "code", 40, 512),
    StreamSpec("tf", "math", 64, 384),
    StreamSpec("sample", "code", 40, 640, max_new_tokens=256, passes=8),
)


def data_root(cache: Path, target_id: str) -> Path:
    return Path(cache) / "data" / target_id


def chat_prefix(tok, prompt: str) -> str:
    """How a prompt of any domain is shown to the target (the same for training and eval)."""
    return tok.apply_chat([{"role": "user", "content": prompt}])


# --------------------------------------------------------------------------- shards


def shard_path(root: Path, stream: str, i: int) -> Path:
    return root / stream / f"shard-{i:05d}.safetensors"


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


@torch.inference_mode()
def label_sequences(target, seqs: list[list[int]], layers: tuple[int, ...], max_batch_tokens: int = 2048):
    """Prefill each token list; returns (top-1 labels [T] int32, hidden [T, n, H] float16), packed."""
    labels, hidden = [], []
    i = 0
    while i < len(seqs):
        batch, n = [], 0
        while i < len(seqs) and (not batch or n + len(seqs[i]) <= max_batch_tokens):
            batch.append(seqs[i])
            n += len(seqs[i])
            i += 1
        cu = [0]
        for s in batch:
            cu.append(cu[-1] + len(s))
        ids = torch.tensor([t for s in batch for t in s], dtype=torch.int64)
        out = target.forward_packed(ids, cu, [target.new_cache(len(s) + 1) for s in batch], logits_index=None,
                                    hidden_layers=layers)
        labels.append(out.logits.argmax(-1).to(torch.int32))
        hidden.append(out.hidden.to(torch.float16))
    return torch.cat(labels), torch.cat(hidden)


def write_shard(path: Path, seqs: list[list[int]], resp_start: list[int], labels, hidden, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    tensors = {
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "labels": labels.contiguous(),
        "hidden": hidden.contiguous(),
        "cu": torch.tensor(cu, dtype=torch.int64),
        "resp_start": torch.tensor(resp_start, dtype=torch.int64),
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"layers": json.dumps(meta["layers"])})
    _atomic_json(path.with_suffix(".json"), meta)
    os.replace(tmp, path)  # the shard exists only once complete


# --------------------------------------------------------------------------- generation


def generate(target, tok, prompts: list[str], max_new_tokens: int, max_running: int = 48,
             temperature: float = 0.0, seeds: list[int] | None = None) -> list[list[int]]:
    """The target's answers to ``prompts`` with the engine (mode ar, batched): greedy, or
    sampled at ``temperature`` with one seed per prompt."""
    from adaflash.config import DataplaneConfig
    from dataplane.engine import Engine
    from dataplane.sequence import SamplingParams, Sequence

    eng = Engine(target, DataplaneConfig(mode="ar", max_running=max_running, max_prefill_tokens=4096),
                 drafter=None, eos_token_ids=[tok.eos_token_id, *target.args.eos_token_ids])
    seqs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                seed=seeds[i] if seeds is not None else None)
        s = Sequence(f"gen-{i}", tok.encode(chat_prefix(tok, p)), params=params)
        seqs.append(s)
        eng.add(s)
    eng.run_until_idle()
    return [list(s.output_ids) for s in seqs]


# --------------------------------------------------------------------------- one shard


def _items(spec: StreamSpec, i: int) -> list[dict]:
    """Shard ``i``'s training items; chat keeps to what the narrow domains' streams never take
    (promptsets/narrow.py ``offline_chat``)."""
    from promptsets.narrow import offline_chat

    if spec.kind == "sample":
        return _sample_items(spec, i)
    off = i * spec.shard_size
    if spec.kind == "tf":
        items = ds.train_texts(spec.domain, spec.shard_size, offset=off)
    else:
        items = ds.train_prompts(spec.domain, spec.shard_size, offset=off)
    if spec.domain == "chat":
        items = [it for it in items if offline_chat(it)]
    return items


def _sample_items(spec: StreamSpec, i: int) -> list[dict]:
    """Shard ``i`` of a ``sample`` stream: a window of the domain's training prompts, in pass
    ``i // shards_per_pass``; each item carries its own seed (``zlib.crc32`` of id and pass)."""
    import zlib

    from promptsets.narrow import offline_chat

    prompts = ds.train_prompts(spec.domain)
    if spec.domain == "chat":
        prompts = [it for it in prompts if offline_chat(it)]
    per_pass = -(-len(prompts) // spec.shard_size)
    if not per_pass or i >= per_pass * spec.passes:
        return []
    pass_, j = divmod(i, per_pass)
    window = prompts[j * spec.shard_size:(j + 1) * spec.shard_size]
    return [{**it, "id": f"{it['id']}#{pass_}", "seed": zlib.crc32(f"{it['id']}#{pass_}".encode())}
            for it in window]


def build_shard(target, tok, spec: StreamSpec, i: int, root: Path, layers: tuple[int, ...]) -> dict | None:
    """Compute shard ``i`` of ``spec`` unless it exists. Returns its meta, or None when the
    stream has no items left."""
    path = shard_path(root, spec.name, i)
    if path.exists():
        return json.loads(path.with_suffix(".json").read_text())
    items = _items(spec, i)
    if not items:
        return None
    t0 = time.time()
    eos = tok.eos_token_id
    seqs, starts, ids, gen_tokens = [], [], [], 0
    if spec.kind == "tf":
        for it in items:
            p = tok.encode(chat_prefix(tok, it["prompt"]))
            r = tok.encode(it["response"]) + [eos]
            s = (p + r)[: spec.max_len]
            if len(p) >= len(s) - 4:
                continue
            seqs.append(s), starts.append(len(p)), ids.append(it["id"])
    else:
        gen_path = path.parent / f"gen-{i:05d}.jsonl"
        if gen_path.exists():
            rows = ds.read_jsonl(str(gen_path))
        else:
            keep = [it for it in items if len(tok.encode(chat_prefix(tok, it["prompt"]))) <= spec.max_prompt_tokens]
            sampled = spec.kind == "sample"
            outs = generate(target, tok, [it["prompt"] for it in keep], spec.max_new_tokens,
                            temperature=SAMPLE_TEMPERATURE if sampled else 0.0,
                            seeds=[it["seed"] for it in keep] if sampled else None)
            rows = [{"id": it["id"], "prompt": it["prompt"], "output_ids": o} for it, o in zip(keep, outs, strict=True)]
            ds.write_jsonl(rows, str(gen_path))
        for r in rows:
            p = tok.encode(chat_prefix(tok, r["prompt"]))
            s = (p + r["output_ids"])[: spec.max_len]
            if len(p) >= len(s) - 4:
                continue
            gen_tokens += len(r["output_ids"])
            seqs.append(s), starts.append(len(p)), ids.append(r["id"])
    if not seqs:
        return None
    labels, hidden = label_sequences(target, seqs, layers)
    n_tok = sum(len(s) for s in seqs)
    meta = {"kind": spec.kind, "domain": spec.domain, "index": i, "ids": ids, "layers": list(layers),
            "precision": str(target.lm_head.weight.dtype).removeprefix("torch."),
            "n_seqs": len(seqs), "n_tokens": n_tok, "n_answer_tokens": sum(len(s) - p for s, p in zip(seqs, starts, strict=True)),
            "generated_tokens": gen_tokens, "seconds": round(time.time() - t0, 1)}
    write_shard(path, seqs, starts, labels, hidden, meta)
    return meta


def prepare(target, tok, root: Path, streams=DEFAULT_STREAMS, max_shards: int = 1000, time_budget_s: float = 0,
            progress: bool = True, first_shard: int = 0) -> dict:
    """Round-robin one shard of each stream at a time until each stream is exhausted,
    ``max_shards`` shards per stream exist, or the time budget is spent. Resumable.

    ``first_shard`` skips the shards below it: shard ``i`` always holds the same prompts,
    so a run that continues a drafter trained on shards ``0..n-1`` elsewhere (the cache
    does not travel with the bundle) starts at ``n`` and makes only text it has not seen."""
    from tqdm import tqdm

    layers = store_layers(target.args.num_layers)
    t0 = time.time()
    done = {s.name: 0 for s in streams}
    live = list(streams)
    bar = tqdm(total=len(streams) * max(0, max_shards - first_shard), disable=not progress, desc="shards",
               unit="shard")
    tokens = 0
    for i in range(first_shard, max_shards):
        for spec in list(live):
            if time_budget_s and time.time() - t0 > time_budget_s:
                bar.close()
                return {"shards": done, "tokens": tokens, "stopped": "time budget"}
            meta = build_shard(target, tok, spec, i, root, layers)
            if meta is None:
                live.remove(spec)
                continue
            done[spec.name] += 1
            tokens += meta["n_tokens"]
            bar.update(1)
            bar.set_postfix(stream=spec.name, tokens=tokens)
        if not live:
            break
    bar.close()
    return {"shards": done, "tokens": tokens, "stopped": "done"}


# --------------------------------------------------------------------------- reading


@dataclass
class Example:
    tokens: torch.Tensor  # [L] int64
    labels: torch.Tensor  # [L] int64, target top-1 after each position
    hidden: torch.Tensor  # [L, n, H] float16
    resp_start: int
    domain: str
    kind: str


def list_shards(root: Path, kinds=KINDS, domains=ds.DOMAINS) -> list[Path]:
    out = []
    for kind in kinds:
        for dom in domains:
            out.extend(sorted((Path(root) / f"{kind}-{dom}").glob("shard-*.safetensors")))
    return out


def load_shard(path: Path, layer_idx: list[int] | None = None) -> list[Example]:
    """All sequences of one shard; ``layer_idx`` picks stored layers (positions in meta['layers'])."""
    meta = json.loads(Path(path).with_suffix(".json").read_text())
    with safe_open(str(path), "pt") as f:
        tokens = f.get_tensor("tokens").long()
        labels = f.get_tensor("labels").long()
        hidden = f.get_tensor("hidden")
        cu = f.get_tensor("cu").tolist()
        starts = f.get_tensor("resp_start").tolist()
    if layer_idx is not None:
        hidden = hidden[:, layer_idx].contiguous()
    return [Example(tokens[cu[j]:cu[j + 1]], labels[cu[j]:cu[j + 1]], hidden[cu[j]:cu[j + 1]], starts[j],
                    meta["domain"], meta["kind"]) for j in range(len(cu) - 1)]


def iter_examples(root: Path, **kw) -> Iterator[Example]:
    for p in list_shards(root, **kw):
        yield from load_shard(p)


def summary(root: Path) -> dict:
    """Token and shard counts per stream (for manifests and reports)."""
    out: dict = {}
    for p in sorted(Path(root).glob("*/shard-*.json")):
        m = json.loads(p.read_text())
        s = out.setdefault(p.parent.name, {"shards": 0, "sequences": 0, "tokens": 0, "answer_tokens": 0})
        s["shards"] += 1
        s["sequences"] += m["n_seqs"]
        s["tokens"] += m["n_tokens"]
        s["answer_tokens"] += m["n_answer_tokens"]
    return out


def labelling_target(settings, precision: str = "served"):
    """(target directory, target) that answers and labels training data. ``served``: the nodes'
    precision (their greedy answers and hidden states are what the drafter meets when it
    serves; bfloat16 also runs about 2.4x faster here); ``training``: the learner's float32."""
    from dataplane.runner import load_target, load_training_target
    from dataplane.target_cache import ensure_target

    if precision != "served":
        return load_training_target(settings, cpu_settings=False)
    d = ensure_target(settings)
    target = load_target(settings, d)
    target.warm_up()
    return d, target


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="prepare target-labelled drafter training data (resumable)")
    ap.add_argument("--max-shards", type=int, default=1000, help="per stream")
    ap.add_argument("--first-shard", type=int, default=0,
                    help="skip the shards below this index (text a continued drafter already trained on)")
    ap.add_argument("--time-budget", type=float, default=0, help="seconds; 0 = no limit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", default="", help="comma list like regen-math,tf-chat (default: all)")
    ap.add_argument("--precision", choices=("served", "training"), default="served",
                    help="the target that answers and labels: as nodes serve it (default; bfloat16 where "
                         "the machine pays for it) or the learner's float32")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from adaflash.config import load_config
    from dataplane.tokenizer import Tokenizer

    settings = load_config()
    d, target = labelling_target(settings, a.precision)
    tok = Tokenizer(d)
    streams = [s for s in DEFAULT_STREAMS if not a.streams or s.name in a.streams.split(",")]
    root = data_root(settings.cache, settings.model.target_id)
    res = prepare(target, tok, root, streams, a.max_shards, a.time_budget, first_shard=a.first_shard)
    print(json.dumps({"result": res, "summary": summary(root)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
