"""The operator CLI drives the whole approval flow against a real control plane, without curl.

`adaflash versions | nodes | tenants | deletions | audit` over HTTP with the typed
client: tables for people, JSON for scripts, the API's message and a distinct exit
status when a call is refused (403 viewer, 404 unknown version, 409 wrong state).
"""

from __future__ import annotations

import json

import pytest

from adaflash.cli import main
from adaflash.controlplane_client import ControlPlaneClient, ControlPlaneError
from tests.controlplane.approval_stack import candidate_awaiting_approval

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def flow(tmp_path_factory, real_target_dir):
    with candidate_awaiting_approval(tmp_path_factory.mktemp("cli"), real_target_dir) as (st, version, admin):
        st.keys = {role: admin.create_key(f"cli-{role}", role).key for role in ("viewer", "approver")}
        st.keys["auditor"] = admin.create_key("cli-auditor", "auditor", tenants=["acme"]).key
        st.keys["admin"] = st.admin_token
        yield st, version


def cli(capsys, monkeypatch, st, role: str, *argv: str) -> tuple[int, str, str]:
    """Run `adaflash ARGV` as ROLE (key from $ADAFLASH_TOKEN, URL from $ADAFLASH_CONTROLPLANE_URL)."""
    monkeypatch.setenv("ADAFLASH_TOKEN", st.keys[role])
    monkeypatch.setenv("ADAFLASH_CONTROLPLANE_URL", st.cp.url)
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_approval_flow_with_the_cli(flow, capsys, monkeypatch):
    st, v = flow
    rc, out, _ = cli(capsys, monkeypatch, st, "viewer", "versions", "list", "--state", "awaiting_approval", "--json")
    assert rc == 0 and [x["version"] for x in json.loads(out)] == [v]
    rc, out, _ = cli(capsys, monkeypatch, st, "viewer", "versions", "show", v)
    assert rc == 0 and "awaiting_approval" in out and "min_tau_gain" in out and "tau_per_tenant" in out

    # A viewer is refused with the API's message and exit status 3; nothing changes.
    rc, _, err = cli(capsys, monkeypatch, st, "viewer", "versions", "approve", v, "--reason", "lgtm")
    assert rc == 3 and "role viewer may not do this" in err and "HTTP 403" in err
    with pytest.raises(SystemExit):  # reject needs a reason: argparse refuses before any call
        main(["versions", "reject", v])

    rc, out, _ = cli(capsys, monkeypatch, st, "approver", "versions", "approve", v, "--reason", "tau up (OPS-1)")
    assert rc == 0 and f"approved {v}: state now approved" in out
    st.drive(lambda: st.state(v) == "champion" and st.nodes["node-a"].drafter()["version"] == v,
             what="approved candidate serving")
    rc, out, _ = cli(capsys, monkeypatch, st, "viewer", "versions", "show", v, "--json")
    shown = json.loads(out)
    assert shown["state"] == "champion" and "champion" in shown["aliases"]
    assert [(a["decision"], a["reason"]) for a in shown["approvals"]] == [("approved", "tau up (OPS-1)")]
    rc, out, _ = cli(capsys, monkeypatch, st, "viewer", "nodes", "list", "--json")
    assert [(n["node_id"], n["served_version"], n["desired_version"]) for n in json.loads(out)] == [("node-a", v, v)]

    # Wrong state (409) and unknown version (404) have their own exit statuses.
    rc, _, err = cli(capsys, monkeypatch, st, "approver", "versions", "approve", v, "--reason", "again")
    assert rc == 5 and "HTTP 409" in err
    rc, _, err = cli(capsys, monkeypatch, st, "viewer", "versions", "show", "no-such-version")
    assert rc == 4 and "HTTP 404" in err

    # Pin and unpin (admin), then the audit chain holds the whole story and verifies.
    rc, out, _ = cli(capsys, monkeypatch, st, "admin", "versions", "pin", v, "--node", "node-a", "--reason", "hold")
    assert rc == 0 and "node-a" in out
    rc, out, _ = cli(capsys, monkeypatch, st, "admin", "versions", "unpin", v, "--reason", "release", "--json")
    assert rc == 0 and json.loads(out)["nodes"] == ["node-a"]
    rc, out, _ = cli(capsys, monkeypatch, st, "viewer", "audit", "verify")
    assert rc == 0 and "audit chain intact" in out
    with ControlPlaneClient(st.cp.url, st.keys["admin"]) as admin:
        actions = [e.action for e in admin.audit(limit=500) if e.target == f"version:{v}"]
    assert "version.approved" in actions


def test_tenant_policy_audit_and_deletion(flow, capsys, monkeypatch):
    st, _ = flow
    rc, out, _ = cli(capsys, monkeypatch, st, "admin", "tenants", "policy", "acme", "--sampling-rate", "0.25",
                     "--opt-out", "--json")
    assert rc == 0 and json.loads(out) == {"tenant_id": "acme", "sampling_rate": 0.25, "opt_out": True,
                                           "ttl_days": 30.0, "share_cap": 0.5, "weight": None,
                                           "max_queued": None, "max_tokens": None}
    rc, _, err = cli(capsys, monkeypatch, st, "viewer", "tenants", "policy", "acme", "--opt-in")
    assert rc == 3 and "HTTP 403" in err
    rc, out, _ = cli(capsys, monkeypatch, st, "viewer", "tenants", "list")
    assert rc == 0 and "acme" in out and "0.25" in out
    rc, out, _ = cli(capsys, monkeypatch, st, "auditor", "tenants", "audit", "acme", "--json")
    trail = json.loads(out)
    assert rc == 0 and trail and {e["tenant_id"] for e in trail} == {"acme"}
    rc, _, err = cli(capsys, monkeypatch, st, "auditor", "tenants", "audit", "globex")
    assert rc == 3 and "HTTP 403" in err

    rc, out, _ = cli(capsys, monkeypatch, st, "admin", "deletions", "request", "globex", "--reason", "GDPR-7", "--json")
    req = json.loads(out)
    assert rc == 0 and req["tenant_id"] == "globex" and req["reason"] == "GDPR-7"
    rc, out, _ = cli(capsys, monkeypatch, st, "viewer", "deletions", "status", str(req["id"]), "--json")
    status = json.loads(out)
    assert rc == 0 and status["id"] == req["id"] and status["state"] in ("pending", "running", "completed")
    assert {(c["component"], c["instance"]) for c in status["components"]} >= {("node", "node-a"), ("learner", "learner")}
    assert "learner:learner" in status["waiting_for"]  # no learner runs here to acknowledge it
    rc, out, _ = cli(capsys, monkeypatch, st, "viewer", "deletions", "status")
    assert rc == 0 and "GDPR-7" in out


def test_refusals_without_credentials_or_control_plane(flow, capsys, monkeypatch):
    st, _ = flow
    st.keys["bogus"] = "adf_0000_not-a-key"
    rc, _, err = cli(capsys, monkeypatch, st, "bogus", "versions", "list")
    assert rc == 3 and "HTTP 401" in err
    rc, _, err = cli(capsys, monkeypatch, st, "viewer", "versions", "list", "--url", "http://127.0.0.1:9")
    assert rc == 6 and "unreachable" in err
    with ControlPlaneClient(st.cp.url, st.keys["viewer"]) as viewer, pytest.raises(ControlPlaneError) as e:
        viewer.reject("1", "no")
    assert e.value.status == 403 and e.value.code == "forbidden"


def test_hold_with_the_cli(flow, capsys, monkeypatch):
    st, _ = flow
    rc, out, _ = cli(capsys, monkeypatch, st, "viewer", "hold", "show")
    assert rc == 0 and "held: nothing" in out
    rc, _, err = cli(capsys, monkeypatch, st, "viewer", "hold", "set", "--learning", "--reason", "measuring")
    assert rc == 3 and "HTTP 403" in err
    rc, _, err = cli(capsys, monkeypatch, st, "admin", "hold", "set", "--reason", "measuring")
    assert rc == 2 and "--learning, --evaluation" in err  # nothing named: refused before any call
    # no learner runs here and nothing is under evaluation: the hold takes effect at once
    rc, out, _ = cli(capsys, monkeypatch, st, "admin", "hold", "set", "--learning", "--evaluation",
                     "--reason", "measuring", "--wait", "5", "--json")
    h = json.loads(out)
    assert rc == 0 and h["learning"] and h["evaluation"] and h["quiet"] and h["reason"] == "measuring"
    rc, out, _ = cli(capsys, monkeypatch, st, "admin", "hold", "lift", "--reason", "measured")
    assert rc == 0 and "held: nothing" in out and "measured" in out
    assert [e.action for e in st.admin.audit(action="hold.set")] == ["hold.set", "hold.set"]
