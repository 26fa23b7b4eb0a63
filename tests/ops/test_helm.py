"""The Helm chart renders with Helm's own engine for every values profile, lints
strictly, and every manifest validates against the Kubernetes 1.30 API schemas."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adaflash.config import Settings

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

CHART = Path(__file__).resolve().parents[2] / "helm" / "adaflash"
PROFILES = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "af", "adaflash"


def _values(profile: str | None) -> dict:
    return yaml.safe_load((CHART / "ci" / profile).read_text()) if profile else {}


@pytest.fixture(scope="module")
def chart():
    c = helm.Chart.load(CHART)
    yield c
    c.close()


_RENDERED: dict[str | None, list[dict]] = {}


def render(chart, profile: str | None) -> list[dict]:
    if profile not in _RENDERED:
        out = chart.render(_values(profile), name=RELEASE, namespace=NAMESPACE, is_install=True)
        docs = []
        for path, text in sorted(out.items()):
            if not path.endswith((".yaml", ".yml")):
                continue
            for doc in yaml.safe_load_all(text):
                if doc:
                    doc.setdefault("metadata", {}).setdefault("annotations", {})
                    doc["_template"] = path
                    docs.append(doc)
        _RENDERED[profile] = docs
    return _RENDERED[profile]


def kinds(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def by_component(docs, kind, component):
    found = [d for d in kinds(docs, kind) if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    assert len(found) == 1, (kind, component, [d["metadata"]["name"] for d in kinds(docs, kind)])
    return found[0]


def pod_spec(doc):
    if doc["kind"] == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return doc["spec"]["template"]["spec"]


def test_profiles_exist():
    assert len(PROFILES) >= 3, PROFILES


@pytest.mark.parametrize("profile", [None, *PROFILES])
def test_lint_strict(profile):
    report = helm.lint(CHART, _values(profile), strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("profile", [None, *PROFILES])
def test_manifests_validate_against_kubernetes_schemas(chart, profile):
    docs = render(chart, profile)
    assert docs
    for doc in docs:
        manifest = {k: v for k, v in doc.items() if k != "_template"}
        if not manifest["metadata"]["annotations"]:
            del manifest["metadata"]["annotations"]
        try:
            kv.validate(manifest, KUBE_VERSION, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{doc['_template']} {doc['kind']}/{doc['metadata']['name']}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")
        # every object is labelled and named within limits
        assert len(doc["metadata"]["name"]) <= 63
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


@pytest.mark.parametrize("profile", [None, *PROFILES])
def test_key_properties(chart, profile):
    docs = render(chart, profile)
    values = chart.merge_values(_values(profile))

    # No Secret objects at all: credentials are references to existing Secrets.
    assert not kinds(docs, "Secret")
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job", "CronJob"):
            for c in pod_spec(doc)["containers"]:
                for env in c.get("env", []):
                    assert not ("PASSWORD" in env["name"] or "TOKEN" in env["name"] or "SECRET" in env["name"]) \
                        or "valueFrom" in env, (doc["metadata"]["name"], env)
                assert c["securityContext"]["allowPrivilegeEscalation"] is False

    dp = by_component(docs, "Deployment", "dataplane")
    (node,) = pod_spec(dp)["containers"]
    assert node["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert node["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert node["args"][:3] == ["--config", "/etc/adaflash/adaflash.yaml", "serve"]
    env = {e["name"]: e for e in node["env"]}
    assert env["OTEL_SERVICE_NAME"]["value"] == "adaflash-dataplane"
    if values["telemetry"]["otlpEndpoint"]:
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == values["telemetry"]["otlpEndpoint"]
    gpu = values["dataplane"]["gpu"]
    limits = node["resources"].get("limits", {})
    assert (gpu["resourceName"] in limits) == gpu["enabled"]
    model = {**yaml.safe_load((CHART / "values.yaml").read_text())["model"], **values.get("model", {})}
    assert dp["metadata"]["labels"]["adaflash.io/device"] == model["device"]

    cfg = yaml.safe_load(kinds(docs, "ConfigMap")[0]["data"]["adaflash.yaml"])
    assert (cfg["model"]["device"], cfg["model"]["dtype"]) == (model["device"], model["dtype"])
    Settings.model_validate(cfg)  # what the chart renders is a configuration nodes accept
    assert cfg["kafka"]["bootstrap"] == values["kafka"]["bootstrap"]
    assert cfg["controlplane"]["mlflow_tracking_uri"] == values["mlflow"]["trackingUri"]
    assert cfg["dataplane"]["controlplane_url"].startswith(f"http://{RELEASE}-adaflash-controlplane:")

    # NetworkPolicies: the nodes admit the control plane; an admin port only from it.
    np = by_component(docs, "NetworkPolicy", "dataplane")
    cp_labels = by_component(docs, "Deployment", "controlplane")["spec"]["selector"]["matchLabels"]
    rules = np["spec"]["ingress"]
    assert any({"podSelector": {"matchLabels": cp_labels}} in r["from"] for r in rules)
    if values["dataplane"].get("adminPort"):
        admin_rules = [r for r in rules if {"port": "admin", "protocol": "TCP"} in r["ports"]]
        assert admin_rules and all(r["from"] == [{"podSelector": {"matchLabels": cp_labels}}] for r in admin_rules)
    by_component(docs, "NetworkPolicy", "controlplane")
    assert by_component(docs, "NetworkPolicy", "learner")["spec"]["ingress"] == []

    if values["dataplane"]["pdb"]["enabled"]:
        assert by_component(docs, "PodDisruptionBudget", "dataplane")
    if values["dataplane"]["hpa"]["enabled"]:
        hpa = by_component(docs, "HorizontalPodAutoscaler", "dataplane")
        assert hpa["spec"]["scaleTargetRef"]["name"] == dp["metadata"]["name"]
        assert "replicas" not in dp["spec"]

    external_db = bool(values["secrets"]["databaseUrl"]["name"]
                       or (values["postgresql"]["host"] and values["secrets"]["postgresPassword"]["name"]))
    jobs = kinds(docs, "Job")
    if external_db:
        (job,) = jobs
        ann = job["metadata"]["annotations"]
        assert set(ann["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
        assert "hook-succeeded" in ann["helm.sh/hook-delete-policy"]
        assert pod_spec(job)["containers"][0]["args"] == ["controlplane", "migrate"]
        # it runs before the release's ConfigMap exists: no ConfigMap volume
        assert all("configMap" not in v for v in pod_spec(job)["volumes"])
        db_env = {e["name"] for e in pod_spec(job)["containers"][0]["env"]}
        assert "ADAFLASH_CONTROLPLANE__DATABASE_URL" in db_env
        sa = pod_spec(job)["serviceAccountName"]
        hook_sas = [d for d in kinds(docs, "ServiceAccount") if d["metadata"]["name"] == sa]
        assert hook_sas and "helm.sh/hook" in hook_sas[0]["metadata"]["annotations"]
        (cron,) = kinds(docs, "CronJob")
        assert pod_spec(cron)["containers"][0]["args"][-2:] == ["controlplane", "reap"]
    else:
        assert not jobs and not kinds(docs, "CronJob")


def test_production_profile_specifics(chart):
    docs = render(chart, "production-values.yaml")
    ingresses = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in kinds(docs, "Ingress")}
    assert set(ingresses) == {"controlplane", "dataplane"}
    paths = [p["path"] for r in ingresses["dataplane"]["spec"]["rules"] for p in r["http"]["paths"]]
    assert paths == ["/v1"]  # never /admin
    assert ingresses["controlplane"]["spec"]["tls"][0]["secretName"] == "adaflash-admin-tls"
    cp = by_component(docs, "Deployment", "controlplane")
    env = {e["name"]: e for e in pod_spec(cp)["containers"][0]["env"]}
    assert env["ADAFLASH_CONTROLPLANE__DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "adaflash-database", "key": "url"}
    assert env["ADAFLASH_JWT_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "adaflash-jwt"
    assert cp["spec"]["strategy"]["type"] == "RollingUpdate"
    cfg = yaml.safe_load(kinds(docs, "ConfigMap")[0]["data"]["adaflash.yaml"])
    assert cfg["governance"] == {"default_ttl_days": 14}  # `config` is merged in
    assert cfg["telemetry"]["sample_ratio"] == 0.2


def test_gpu_profile_runs_our_engine_on_cuda_in_bfloat16(chart):
    docs = render(chart, "gpu-cuda-bf16-values.yaml")
    dp = by_component(docs, "Deployment", "dataplane")
    spec = pod_spec(dp)
    node = spec["containers"][0]
    assert node["image"] == "registry.example.com/adaflash/adaflash:0.1.0"  # the project's own image
    assert node["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "admin", "containerPort": 8001, "protocol": "TCP"} in node["ports"]
    cfg = Settings.model_validate(yaml.safe_load(kinds(docs, "ConfigMap")[0]["data"]["adaflash.yaml"]))
    assert (cfg.model.device, cfg.model.dtype) == ("cuda", "bfloat16")
    assert "sglang" not in yaml.safe_dump(docs).lower()  # nothing names an engine that does not run
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "adaflash-models" for v in spec["volumes"])
    cp = by_component(docs, "Deployment", "controlplane")
    env = {e["name"]: e for e in pod_spec(cp)["containers"][0]["env"]}
    names = list(env)
    assert names.index("ADAFLASH_PG_PASSWORD") < names.index("ADAFLASH_CONTROLPLANE__DATABASE_URL")
    assert "$(ADAFLASH_PG_PASSWORD)@postgres.db.svc:5432/adaflash" in env["ADAFLASH_CONTROLPLANE__DATABASE_URL"]["value"]


def test_minimal_profile_has_no_disruption_budget(chart):
    docs = render(chart, "minimal-cpu-values.yaml")
    assert not kinds(docs, "PodDisruptionBudget") and not kinds(docs, "HorizontalPodAutoscaler")
    np = by_component(docs, "NetworkPolicy", "dataplane")
    assert {"podSelector": {}} in np["spec"]["ingress"][0]["from"]


@pytest.mark.parametrize("bad", [
    {"dataplan": {"replicaCount": 2}},  # typo in a top-level key
    {"dataplane": {"replicas": 2}},  # typo one level down
    {"dataplane": {"engine": "sglang"}},  # no such engine in the chart until it runs
    {"model": {"device": "tpu"}},
    {"telemetry": {"exporter": "jaeger"}},
    {"secrets": {"adminToken": {"name": "adaflash-admin", "key": "token", "value": "hunter2"}}},
    {"adminToken": "hunter2"},
])
def test_schema_rejects_bad_values(chart, bad):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)
    with pytest.raises(helm.HelmError):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE, is_install=True)


def test_values_yaml_holds_no_secret_values():
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node, path=()):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, (*path, k))
        else:
            yield path, node

    for path, value in walk(values["secrets"]):
        assert path[-1] in ("name", "key", "usernameKey", "passwordKey") or path == ("extraEnvFromSecret",), path
        if path[-1] == "name" or path == ("extraEnvFromSecret",):
            assert value == ""
