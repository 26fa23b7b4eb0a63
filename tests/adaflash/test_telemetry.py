"""Telemetry: providers per service, traceparent through Kafka headers, exporters, histograms."""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from adaflash.config import Settings, TelemetryConfig, load_config
from adaflash.contracts import HEADER_TRACEPARENT
from adaflash.telemetry import (
    CONTROLPLANE,
    DATAPLANE,
    LEARNER,
    Metrics,
    SpanAttrs,
    Spans,
    context_from_headers,
    extract_context,
    inject_traceparent,
    links_from_traceparents,
    record_request_latency,
    setup_telemetry,
    traceparent_from_headers,
    traceparent_header,
    tracer,
)


def _settings(tmp_path, **telemetry) -> Settings:
    return load_config(None, home=tmp_path, telemetry=TelemetryConfig(**{"exporter": "memory", **telemetry}))


def test_span_crosses_kafka_headers_between_services(tmp_path):
    a = setup_telemetry(DATAPLANE, _settings(tmp_path))
    b = setup_telemetry(LEARNER, _settings(tmp_path))
    with a.tracer("node").start_as_current_span(Spans.REQUEST, attributes={SpanAttrs.TENANT: "acme"}):
        with a.tracer("node").start_as_current_span(Spans.PRODUCE) as produce:
            headers = [("schema_version", b"1"), *traceparent_header()]
            produce_ctx = produce.get_span_context()
    # what a Kafka consumer hands back: a list of (str, bytes)
    assert all(isinstance(v, bytes) for _, v in headers)
    tp = traceparent_from_headers(headers)
    assert tp and tp.startswith("00-") and int(tp.rsplit("-", 1)[1], 16) & 1  # sampled
    with b.tracer("learner").start_as_current_span(Spans.TRAIN_STEP, context=context_from_headers(headers)) as step:
        child_ctx = step.get_span_context()

    assert child_ctx.trace_id == produce_ctx.trace_id
    (learner_span,) = b.finished_spans()
    assert learner_span.parent.span_id == produce_ctx.span_id
    assert learner_span.parent.is_remote
    assert learner_span.resource.attributes["service.name"] == LEARNER
    names = [s.name for s in a.finished_spans()]
    assert names == [Spans.PRODUCE, Spans.REQUEST]
    assert {s.resource.attributes["service.name"] for s in a.finished_spans()} == {DATAPLANE}


def test_inject_extract_roundtrip_and_edge_cases(tmp_path):
    tel = setup_telemetry(CONTROLPLANE, _settings(tmp_path))
    assert inject_traceparent() == ""  # no current span
    assert extract_context("") == extract_context(None)
    assert not trace.get_current_span(extract_context("garbage")).get_span_context().is_valid
    span = tel.tracer().start_span(Spans.GATE)
    tp = inject_traceparent(span)
    assert tp == inject_traceparent(span.get_span_context())
    sc = trace.get_current_span(extract_context(tp.encode())).get_span_context()
    assert (sc.trace_id, sc.span_id) == (span.get_span_context().trace_id, span.get_span_context().span_id)
    span.end()
    assert traceparent_from_headers({HEADER_TRACEPARENT: tp.encode()}) == tp
    assert traceparent_from_headers([(b"traceparent", tp.encode())]) == tp
    assert traceparent_from_headers(None) is None
    assert traceparent_header(trace.INVALID_SPAN_CONTEXT) == []


def test_train_step_links_many_records(tmp_path):
    node = setup_telemetry(DATAPLANE, _settings(tmp_path))
    learner = setup_telemetry(LEARNER, _settings(tmp_path))
    tps = []
    for _ in range(3):
        with node.tracer().start_as_current_span(Spans.REQUEST):
            tps.append(inject_traceparent())
    links = links_from_traceparents([*tps, tps[0], None, b"bad"])
    assert len(links) == 3
    with learner.tracer().start_as_current_span(Spans.TRAIN_STEP, links=links):
        pass
    (step,) = learner.finished_spans()
    assert {format(link.context.trace_id, "032x") for link in step.links} == {tp.split("-")[1] for tp in tps}


def test_setup_twice_and_proxy_tracer_follows(tmp_path):
    proxy = tracer("dataplane.engine", service=DATAPLANE)
    with proxy.start_as_current_span(Spans.QUEUE) as s:  # before setup: no-op
        assert not s.is_recording()
    first = setup_telemetry(DATAPLANE, _settings(tmp_path))
    with proxy.start_as_current_span(Spans.PREFILL):
        pass
    second = setup_telemetry(DATAPLANE, _settings(tmp_path))
    with proxy.start_as_current_span(Spans.SPEC_ROUND, attributes={SpanAttrs.K_HAT: 4, SpanAttrs.ACCEPTED: 2}):
        pass
    assert [s.name for s in first.finished_spans()] == [Spans.PREFILL]
    (round_span,) = second.finished_spans()
    assert round_span.attributes[SpanAttrs.K_HAT] == 4 and round_span.attributes[SpanAttrs.ACCEPTED] == 2
    # the default (no service) follows the last set up
    other = setup_telemetry(LEARNER, _settings(tmp_path))
    with tracer("x").start_as_current_span(Spans.PUBLISH):
        pass
    assert [s.name for s in other.finished_spans()] == [Spans.PUBLISH]


def test_shared_memory_exporter_builds_one_tree(tmp_path):
    shared = InMemorySpanExporter()
    setup_telemetry(DATAPLANE, _settings(tmp_path, exporter="none"), span_exporter=shared)
    setup_telemetry(LEARNER, _settings(tmp_path, exporter="none"), span_exporter=shared)
    with tracer("n", service=DATAPLANE).start_as_current_span(Spans.REQUEST) as root:
        with tracer("n", service=DATAPLANE).start_as_current_span(Spans.SCRUB):
            pass
        hdrs = traceparent_header()
    with tracer("l", service=LEARNER).start_as_current_span(Spans.TRAIN_STEP, context=context_from_headers(hdrs)):
        pass
    spans = {s.name: s for s in shared.get_finished_spans()}
    assert spans[Spans.TRAIN_STEP].parent.span_id == root.get_span_context().span_id
    assert spans[Spans.SCRUB].parent.span_id == root.get_span_context().span_id
    assert spans[Spans.TRAIN_STEP].resource.attributes["service.name"] == LEARNER


def test_latency_histograms_per_tenant(tmp_path):
    tel = setup_telemetry(DATAPLANE, _settings(tmp_path))
    tel.record_request_latency("acme", 0.2, [0.01, 0.02, 0.03], 1.5)
    record_request_latency("globex", 0.4, [], 2.0, service=DATAPLANE)
    data = tel.metrics_data()
    points: dict[str, dict[str, tuple[int, float]]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    points.setdefault(m.name, {})[p.attributes[SpanAttrs.TENANT]] = (p.count, p.sum)
                    if m.name == Metrics.TTFT:
                        assert tuple(p.explicit_bounds) == Metrics.TTFT_BUCKETS
    assert points[Metrics.TTFT] == {"acme": (1, pytest.approx(0.2)), "globex": (1, pytest.approx(0.4))}
    assert points[Metrics.INTER_TOKEN_LATENCY] == {"acme": (3, pytest.approx(0.06))}
    assert points[Metrics.E2E_LATENCY]["globex"] == (1, pytest.approx(2.0))


def test_file_exporter_writes_json_lines(tmp_path):
    tel = setup_telemetry(LEARNER, _settings(tmp_path, exporter="file", metrics_interval_s=3600))
    assert tel.traces_path == tmp_path / f"traces-{LEARNER}.jsonl"
    with tel.tracer().start_as_current_span(Spans.TRAIN_STEP, attributes={SpanAttrs.RECORDS: 32}):
        with tel.tracer().start_as_current_span(Spans.PUBLISH):
            pass
    tel.record_request_latency("t", 0.1, [0.01], 0.5)
    tel.shutdown()
    rows = [json.loads(line) for line in tel.traces_path.read_text().splitlines()]
    by_name = {r["name"]: r for r in rows}
    assert by_name[Spans.PUBLISH]["parent_span_id"] == by_name[Spans.TRAIN_STEP]["span_id"]
    assert by_name[Spans.TRAIN_STEP]["attributes"] == {SpanAttrs.RECORDS: 32}
    assert by_name[Spans.TRAIN_STEP]["service"] == LEARNER
    assert tel.metrics_path.read_text().strip()  # final collection on shutdown


def test_file_path_template_and_otlp_urls(tmp_path):
    from adaflash.telemetry.exporters import _otlp_urls

    s = _settings(tmp_path, exporter="file", file_path=str(tmp_path / "t" / "spans-{service}.jsonl"))
    tel = setup_telemetry(CONTROLPLANE, s)
    assert tel.traces_path == tmp_path / "t" / f"spans-{CONTROLPLANE}.jsonl"
    assert _otlp_urls("http://c:4318/") == ("http://c:4318/v1/traces", "http://c:4318/v1/metrics")
    assert _otlp_urls("http://c:4318/v1/traces") == ("http://c:4318/v1/traces", "http://c:4318/v1/metrics")
    assert _otlp_urls("") == (None, None)


@pytest.mark.parametrize("kind", ["none", "console", "otlp"])
def test_every_exporter_sets_up_and_shuts_down(tmp_path, kind):
    tel = setup_telemetry(CONTROLPLANE, _settings(tmp_path, exporter=kind, otlp_endpoint="http://127.0.0.1:9"))
    assert tel.tracer_provider.resource.attributes["service.name"] == CONTROLPLANE
    if kind == "none":
        with tel.tracer().start_as_current_span(Spans.ROLLOUT):
            pass
    tel.shutdown()
    tel.shutdown()  # idempotent


def test_span_names_are_fixed():
    assert Spans.ALL == ("request", "queue", "prefill", "spec_round", "scrub", "produce", "train_step",
                         "publish", "shadow_evaluation", "gate", "rollout")
