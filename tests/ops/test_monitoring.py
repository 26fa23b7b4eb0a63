"""The Grafana dashboard and the Prometheus alerts shipped in the Helm chart.

Rendered with Helm's own engine; the dashboard's ConfigMap validates against the
Kubernetes schemas; every metric either one uses is one the services really export
(collected from the code's own registries, and the OpenTelemetry instruments under the
names the collector gives them in Prometheus); the rules pass `promtool check rules`,
and `promtool test rules` shows each alert firing on the series it is meant for.
"""

from __future__ import annotations

import json
import re
import subprocess
from contextlib import nullcontext
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

CHART = Path(__file__).resolve().parents[2] / "helm" / "adaflash"
RELEASE, NAMESPACE = "af", "adaflash"
METRIC = re.compile(r"\badaflash_[a-z0-9_]+\b")
PROMTOOL = "/usr/bin/promtool"
RULES_ON = {"monitoring": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"},
                                              "runbookBaseUrl": "https://git.example/runbooks/"}}}


def rendered(values: dict) -> list[dict]:
    c = helm.Chart.load(CHART)
    try:
        out = c.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    finally:
        c.close()
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def component(docs: list[dict], kind: str, name: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["labels"]["app.kubernetes.io/component"] == name]


def exported_metric_names() -> set[str]:
    """Every series name the code exports: the node's and the emitter's Prometheus
    registries, the control plane's collector, and the OpenTelemetry latency histograms."""
    from adaflash.config import load_config
    from adaflash.telemetry import Metrics
    from controlplane.metrics import ControlPlaneCollector
    from dataplane.metrics import NodeMetrics
    from governance.emitter import _Metrics as EmitterMetrics

    names: set[str] = set()
    for registry in (NodeMetrics(16).registry, EmitterMetrics().registry):
        for fam in registry.collect():
            names.add(fam.name)
            names.update(s.name for s in fam.samples)
            if fam.type == "histogram":  # series exist before the first observation too
                names.update(f"{fam.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
            if fam.type == "counter":
                names.add(f"{fam.name}_total")
    # The control plane's families (gauges: one series name each), on an empty database.
    collector = ControlPlaneCollector(lambda: nullcontext(_EmptySession()), load_config(), None)
    names.update(f.name for f in collector.collect())
    # OpenTelemetry -> Prometheus (the collector's translation): dots become underscores
    # and a unit of seconds appends _seconds; histograms are _bucket / _sum / _count.
    for name in (Metrics.TTFT, Metrics.INTER_TOKEN_LATENCY, Metrics.E2E_LATENCY):
        base = name.replace(".", "_") + "_seconds"
        names.update({base, f"{base}_bucket", f"{base}_sum", f"{base}_count"})
    return names


class _EmptySession:
    """Answers the collector's queries as an empty database would."""

    def execute(self, _):
        class R:
            def all(self):
                return []

        return R()

    def scalar(self, _):
        return None

    def scalars(self, _):
        return []

    def get(self, *_):
        return None


@pytest.fixture(scope="module")
def exported():
    return exported_metric_names()


def dashboard_exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_configmap_validates_and_carries_the_dashboard(exported):
    docs = rendered({})
    (cm,) = component(docs, "ConfigMap", "dashboards")
    kv.validate(cm, "1.30.0", strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["adaflash.json"])
    assert dash == json.loads((CHART / "dashboards" / "adaflash.json").read_text())
    assert dash["uid"] == "adaflash-overview" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    used = {m for e in dashboard_exprs(dash) for m in METRIC.findall(e)}
    unknown = used - exported
    assert not unknown, f"dashboard uses metrics nobody exports: {sorted(unknown)}"
    # what operators asked to see, each from the metric that measures it
    for needed in ("adaflash_tps", "adaflash_request_ttft_seconds_bucket",
                   "adaflash_request_inter_token_latency_seconds_bucket", "adaflash_tau_live", "adaflash_k_hat_bucket",
                   "adaflash_position_accepted_total", "adaflash_drafter_info", "adaflash_feedback_dropped_total",
                   "adaflash_feedback_spool_records", "adaflash_learner_lag_records", "adaflash_controlplane_versions"):
        assert needed in used, needed
    assert not component(docs, "PrometheusRule", "alerts")  # off unless enabled
    assert not component(rendered({"monitoring": {"grafanaDashboard": {"enabled": False}}}), "ConfigMap", "dashboards")


@pytest.fixture(scope="module")
def rule_groups() -> list[dict]:
    (rule,) = component(rendered(RULES_ON), "PrometheusRule", "alerts")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "kps"
    return rule["spec"]["groups"]


def test_rules_are_well_formed_and_use_exported_metrics(rule_groups, exported):
    alerts = {r["alert"]: r for g in rule_groups for r in g["rules"]}
    assert {"AdaFlashAcceptanceRegression", "AdaFlashFeedbackSpoolGrowing", "AdaFlashScrubDrops",
            "AdaFlashLearnerLag"} <= set(alerts)
    for name, r in alerts.items():
        assert set(r) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"[0-9]+[smhd]", r["for"]) and r["labels"]["severity"] in ("info", "warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        used = set(METRIC.findall(r["expr"]))
        assert used and not used - exported, (name, sorted(used - exported))
        assert f'namespace="{NAMESPACE}"' in r["expr"]
    assert alerts["AdaFlashAcceptanceRegression"]["annotations"]["runbook_url"].endswith("/runbooks/acceptance-collapse.md")
    # the drop reasons the scrub alert matches are the ones the emitter counts
    emitter = (CHART.parents[1] / "governance" / "emitter.py").read_text()
    for reason in re.search(r'reason=~"([^"]+)"', alerts["AdaFlashScrubDrops"]["expr"]).group(1).split("|"):
        assert f'"{reason}"' in emitter, reason


@pytest.fixture(scope="module")
def rules_file(rule_groups, tmp_path_factory) -> Path:
    if not Path(PROMTOOL).exists():
        pytest.fail(f"no {PROMTOOL}: `make setup` installs Debian's prometheus package for it")
    path = tmp_path_factory.mktemp("rules") / "adaflash-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups}, sort_keys=False))
    return path


def test_promtool_checks_the_rules(rules_file):
    r = subprocess.run([PROMTOOL, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 5 rules found" in r.stdout


def _series(metric: str, labels: dict, values: str) -> dict:
    inner = ",".join(f'{k}="{v}"' for k, v in {"namespace": NAMESPACE, **labels}.items())
    return {"series": f"{metric}{{{inner}}}", "values": values}


def _annotations(rule_groups, alert: str, value: str, pod: str = "") -> dict:
    """The alert's annotations as Prometheus expands them for this value and pod."""
    (rule,) = [r for g in rule_groups for r in g["rules"] if r["alert"] == alert]
    out = {}
    for k, text in rule["annotations"].items():
        text = re.sub(r"\{\{ \$value[^}]*\}\}", value, text)
        out[k] = text.replace("{{ $labels.pod }}", pod)
    return out


def test_promtool_fires_each_alert_on_its_condition(rules_file, rule_groups, tmp_path):
    """Synthetic series at one sample a minute: each alert fires where it should and not before."""
    pod = {"pod": "af-adaflash-dataplane-0"}
    warn = {"severity": "warning", "team": "adaflash"}

    def fired(alert: str, value: str, **labels) -> list[dict]:
        return [{"exp_labels": {**warn, **labels},
                 "exp_annotations": _annotations(rule_groups, alert, value, labels.get("pod", ""))}]

    tests = {"rule_files": [str(rules_file)], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": [
            # 8 h of speculation: 3 accepted tokens per round, then 1 per round from 7h30 on
            _series("adaflash_spec_rounds_total", pod, "0+60x480"),
            _series("adaflash_accepted_tokens_total", pod, "0+180x450 81000+60x30"),
            # a spool that fills from 600 records by 20 a minute
            _series("adaflash_feedback_spool_records", pod, "600+20x60"),
            # 6 scrub failures a minute (0.1/s), and opt-out drops that must not count
            _series("adaflash_feedback_dropped_total", {**pod, "tenant": "acme", "reason": "scrub_error"}, "0+6x60"),
            _series("adaflash_feedback_dropped_total", {**pod, "tenant": "acme", "reason": "opt_out"}, "0+600x60"),
            _series("adaflash_learner_lag_records", {"partition": "0"}, "20000x60"),
            _series("adaflash_learner_lag_up", {}, "1x60"),
            _series("adaflash_controlplane_hold", {"what": "learning"}, "0x60"),
        ], "alert_rule_test": [
            {"eval_time": "7h20m", "alertname": "AdaFlashAcceptanceRegression", "exp_alerts": []},
            {"eval_time": "7h59m", "alertname": "AdaFlashAcceptanceRegression",
             "exp_alerts": fired("AdaFlashAcceptanceRegression", "1")},
            {"eval_time": "10m", "alertname": "AdaFlashFeedbackSpoolGrowing", "exp_alerts": []},
            {"eval_time": "50m", "alertname": "AdaFlashFeedbackSpoolGrowing",
             "exp_alerts": fired("AdaFlashFeedbackSpoolGrowing", "1600", namespace=NAMESPACE, **pod)},
            {"eval_time": "30m", "alertname": "AdaFlashScrubDrops", "exp_alerts": fired("AdaFlashScrubDrops", "0.10")},
            {"eval_time": "30m", "alertname": "AdaFlashLearnerLag", "exp_alerts": fired("AdaFlashLearnerLag", "20k")},
            {"eval_time": "30m", "alertname": "AdaFlashLearnerLagUnknown", "exp_alerts": []},
        ]}, {"interval": "1m", "input_series": [
            # the same lag while an admin holds learning: expected, nobody is paged
            _series("adaflash_learner_lag_records", {"partition": "0"}, "20000x60"),
            _series("adaflash_learner_lag_up", {}, "1x60"),
            _series("adaflash_controlplane_hold", {"what": "learning"}, "1x60"),
        ], "alert_rule_test": [
            {"eval_time": "30m", "alertname": "AdaFlashLearnerLag", "exp_alerts": []},
        ]}]}
    path = tmp_path / "rules-test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
