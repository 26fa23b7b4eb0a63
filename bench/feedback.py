"""``adaflash bench feedback``: serving TPS with feedback on vs off, same engine, same run.

Feedback on means the whole governed path: every finished request builds a record,
the emitter scrubs it (Presidio, in its niced child process) and produces it to a real
Kafka-protocol broker (Tansu started here on a loopback port). Runs alternate off / on
so that drift of a shared machine hits both equally; the figure is the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

# The governed feedback path (record, scrub, produce) may cost serving at most this share of its tokens/s.
OVERHEAD_BOUND = 0.03


def register_bench(bsub: argparse._SubParsersAction) -> None:
    f = bsub.add_parser("feedback", help="serving TPS with feedback on vs off")
    f.add_argument("--concurrency", type=int, default=8)
    f.add_argument("--requests", type=int, default=16, help="requests per run")
    f.add_argument("--max-tokens", type=int, default=48)
    f.add_argument("--pairs", type=int, default=2, help="off/on run pairs")
    f.add_argument("--drafter", default=None)
    f.add_argument("--out", default="out/bench-feedback")
    f.set_defaults(func=main)


def main(args, settings) -> int:
    from adaflash.cli import CliError

    if args.concurrency < 1 or args.requests < 1 or args.pairs < 1:
        raise CliError("--concurrency, --requests and --pairs must be positive")
    result = run(settings, args.concurrency, args.requests, args.max_tokens, args.pairs, args.drafter, Path(args.out))
    print(json.dumps(result, indent=2))
    return 0


def run(settings, concurrency: int, n_requests: int, max_tokens: int, pairs: int, drafter: str | None,
        out: Path) -> dict:
    from bench.throughput import run_closed_loop
    from dataplane.engine import Engine
    from dataplane.node import Node
    from governance.broker import TansuBroker
    from governance.emitter import build_emitter
    from promptsets import heldout_prompts

    out.mkdir(parents=True, exist_ok=True)
    settings.home = out / "home"
    if drafter:
        settings.dataplane = settings.dataplane.model_copy(update={"drafter": drafter})
    node = Node(settings)
    tok = node.tokenizer
    prompts = [p for d in ("chat", "code", "math") for p in heldout_prompts(d, max(1, n_requests // 3 + 1))]
    ids = [tok.encode(tok.apply_chat([{"role": "user", "content": p["prompt"]}]))[:512] for p in prompts]
    ids = [ids[i % len(ids)] for i in range(n_requests)]
    runs = []
    with TansuBroker() as broker:
        emitter = build_emitter(settings, bootstrap=broker.bootstrap)
        emitter.submit(node.feedback_record(_warm_request(ids[0])))  # start the scrubber child first
        emitter.drain(timeout=180)
        for i in tqdm(range(2 * pairs), desc="feedback off/on", unit="run"):
            on = i % 2 == 1
            engine = Engine(node.target, settings.dataplane, drafter=node.engine.drafter,
                            drafter_version=node.engine.drafter_version, eos_token_ids=[tok.eos_token_id],
                            max_model_len=settings.model.max_model_len)
            if on:  # the node's path: the engine thread queues, the node's builder builds the record
                node.emitter = emitter
                engine.on_finish = node.on_request_finished
            r = run_closed_loop(engine, ids, concurrency, max_tokens)
            r.pop("outputs"), r.pop("head_samples")
            runs.append({"feedback": on, **r})
        t0 = time.perf_counter()
        drained = node.feedback.drain(timeout=600) and emitter.drain(timeout=600)
        drain_s = time.perf_counter() - t0
        counters = emitter.counters()
        emitter.close()
    off = [r["tps"] for r in runs if not r["feedback"]]
    on = [r["tps"] for r in runs if r["feedback"]]
    overhead = 1 - statistics.fmean(on) / statistics.fmean(off)
    result = {"concurrency": concurrency, "requests_per_run": n_requests, "max_tokens": max_tokens,
              "tps_off": statistics.fmean(off), "tps_on": statistics.fmean(on),
              "overhead": overhead, "overhead_bound": OVERHEAD_BOUND, "within_bound": overhead <= OVERHEAD_BOUND,
              "drained_after_s": drain_s, "drained": drained, "emitter": counters, "runs": runs,
              "mode": settings.dataplane.mode, "scrubber": settings.governance.scrubber}
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    _plot(result, out / "plot.png")
    return result


def _warm_request(ids):
    from dataplane.envelope import RequestEnvelope
    from dataplane.feedback import FinishedRequest

    return FinishedRequest(request_id="warmup", tenant_id="bench", output_ids=[ids[-1]], stop=[], temperature=0.0,
                           top_p=1.0, drafter_version=None,
                           envelope=RequestEnvelope(prompt_text="warm-up request for the scrubber"))


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = list(range(len(result["runs"])))
    ax.bar(xs, [r["tps"] for r in result["runs"]],
           color=["tab:green" if r["feedback"] else "tab:grey" for r in result["runs"]])
    ax.set_xticks(xs, ["on" if r["feedback"] else "off" for r in result["runs"]])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"feedback overhead {result['overhead'] * 100:.1f}% at C={result['concurrency']} "
                 f"(bound {result['overhead_bound'] * 100:.0f}%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
