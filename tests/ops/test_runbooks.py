"""Runbooks: all present, same structure, only contract endpoints, snippets that parse."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
REQUIRED = ["approve-and-promote", "roll-back", "acceptance-collapse", "broker-outage",
            "learner-stuck-or-lagging", "tenant-deletion", "rotate-admin-keys", "scale-out-nodes"]

# The admin API and node endpoints the runbooks may call (DESIGN.md and the admin API list).
API_PATHS = [
    ("GET", r"versions"), ("GET", r"versions/{}"), ("POST", r"versions/{}/approve"),
    ("POST", r"versions/{}/reject"), ("POST", r"versions/{}/rollback"), ("POST", r"versions/{}/pin"),
    ("POST", r"versions/{}/unpin"), ("GET", r"nodes"), ("GET", r"nodes/{}"), ("GET", r"tenants/{}/policy"), ("PUT", r"tenants/{}/policy"),
    ("POST", r"deletion-requests"), ("GET", r"deletion-requests"), ("GET", r"deletion-requests/{}"), ("POST", r"deletion-requests/{}/ack"),
    ("GET", r"audit"), ("GET", r"audit/verify"),
    ("GET", r"keys"), ("POST", r"keys"), ("DELETE", r"keys/{}"),
]
NODE_PATHS = [("GET", "metrics"), ("GET", "readyz"), ("GET", "healthz"), ("GET", "admin/drafter"),
              ("POST", "admin/drafter")]
CALL = re.compile(r"""(?:api|curl)\b(?P<opts>[^\n]*?)["']?\$(?P<base>API|NODE)/(?P<path>[A-Za-z0-9_./{}<>$-]+)""")


def _normalise(path: str) -> str:
    path = re.sub(r"(\$[A-Z_]+|<[^>]+>)", "{}", path.rstrip("\"'"))
    return re.sub(r"^nodes/[A-Za-z0-9_.-]+$", "nodes/{}", path)  # a literal node id


def _text(name: str) -> str:
    return (RUNBOOKS / f"{name}.md").read_text()


@pytest.mark.parametrize("name", REQUIRED)
def test_runbook_structure(name):
    text = _text(name)
    assert text.startswith("# ")
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert any(h.startswith("Symptoms") for h in headings), headings
    assert any(h.startswith("What to look at") or h.startswith("Before you start") for h in headings), headings
    assert "Verify" in headings, headings
    assert "```sh" in text


def test_index_links_every_runbook_and_links_resolve():
    index = (RUNBOOKS / "README.md").read_text()
    for name in REQUIRED:
        assert f"({name}.md)" in index
    for md in RUNBOOKS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.md)\)", md.read_text()):
            assert (RUNBOOKS / target).is_file(), (md.name, target)


def test_only_contract_endpoints_are_called():
    calls = 0
    for md in RUNBOOKS.glob("*.md"):
        for m in CALL.finditer(md.read_text()):
            opts = m["opts"]
            method = re.search(r"-X\s+(\w+)", opts)
            method = method.group(1) if method else "GET"
            path = _normalise(m["path"])
            allowed = API_PATHS if m["base"] == "API" else NODE_PATHS
            assert (method, path) in allowed, (md.name, method, m["base"], path)
            calls += 1
    assert calls > 40


def test_token_comes_from_the_admin_token_file():
    index = (RUNBOOKS / "README.md").read_text()
    # endpoints and the token file come from `adaflash status --json`, never fixed ports
    assert "adaflash status --json > /tmp/adaflash-status.json" in index
    assert 'export TOKEN="$(cat "$(ep admin_token_file)")"' in index
    for var, key in (("API", "controlplane_api"), ("NODE", "dataplane_url"), ("KAFKA", "kafka_bootstrap")):
        assert f'export {var}="$(ep {key})"' in index


def test_python_snippets_parse():
    found = 0
    for md in RUNBOOKS.glob("*.md"):
        text = md.read_text()
        for block in re.findall(r"python3 - <<'PY'\n(.*?)\nPY\n", text, flags=re.S):
            ast.parse(block)
            found += 1
        for one in re.findall(r"python3 -c '([^']*)'", text):
            ast.parse(one)
            found += 1
    assert found >= 4
