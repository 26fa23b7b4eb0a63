"""Shadow evaluation: champion and candidate replayed on held-out, recent, scrubbed feedback.

One module per job:
- ``window``: where feedback comes from (Kafka tail, JSONL, list) and which records count;
- ``replay``: one drafter on one record, walked by the node's speculation policy;
- ``aggregate``: replays into an ``EvaluationReport`` (tau and predicted TPS per tenant);
- ``plots``: the report's PNGs, and predicted against realised figures per version;
- ``evaluator``: the DB-backed worker that evaluates, stores and gates versions;
- ``store``: where reports and plots live on disk.
"""

from controlplane.shadow.aggregate import ShadowResult, ar_throughput, evaluate_drafters
from controlplane.shadow.evaluator import SYSTEM_SHADOW, Outcome, ShadowEvaluator
from controlplane.shadow.plots import plot_predicted_realised, write_plots
from controlplane.shadow.replay import (
    Replay,
    Trace,
    encode_record,
    replay_drafter,
    target_pass,
    trace_drafter,
    walk,
)
from controlplane.shadow.store import evaluations_dir
from controlplane.shadow.window import (
    FeedbackWindow,
    KafkaFeedbackWindow,
    RecordsWindow,
    select_window,
    window_from_settings,
)

__all__ = [
    "SYSTEM_SHADOW", "FeedbackWindow", "KafkaFeedbackWindow", "Outcome", "RecordsWindow", "Replay", "ShadowEvaluator",
    "ShadowResult", "Trace", "ar_throughput", "encode_record", "evaluate_drafters", "evaluations_dir",
    "plot_predicted_realised", "replay_drafter", "select_window", "target_pass", "trace_drafter", "walk",
    "window_from_settings", "write_plots",
]
