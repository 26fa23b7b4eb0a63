"""Record claims: one learner trains each record across the group (controlplane/claims.py).

Through the HTTP API (SQLite, and PostgreSQL on the same tests), with learner keys bound
to their learner ids; the lease and the retention are driven with an explicit clock."""

from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane import claims
from controlplane.db import utcnow

pytestmark = pytest.mark.parametrize("settings", ["sqlite", "postgresql"], indirect=True)


def _claims(client, key, learner, claim=(), trained=()):
    return client.post(f"/api/v1/learners/{learner}/claims", headers=key,
                       json={"claim": list(claim), "trained": list(trained)})


def test_a_record_trained_by_one_learner_is_refused_to_the_other(client, make_key):
    a, b = make_key("learner", node_id="learner"), make_key("learner", node_id="learner-2")
    r = _claims(client, a, "learner", claim=["r1", "r2"])
    assert r.status_code == 200, r.text
    assert sorted(r.json()["granted"]) == ["r1", "r2"] and r.json()["held_elsewhere"] == {}
    # learner-2 reads r2 and r3 again (a broker that came back empty): r2 is held by learner, for now
    r = _claims(client, b, "learner-2", claim=["r2", "r3"])
    assert r.json() == {"granted": ["r3"], "trained_elsewhere": {}, "held_elsewhere": {"r2": "learner"}}
    # learner reports r1 and r2 trained; claiming them again is idempotent for it
    r = _claims(client, a, "learner", claim=["r1"], trained=["r1", "r2"])
    assert r.json() == {"granted": ["r1"], "trained_elsewhere": {}, "held_elsewhere": {}}
    r = _claims(client, b, "learner-2", claim=["r1", "r2"])
    assert r.json() == {"granted": [], "trained_elsewhere": {"r1": "learner", "r2": "learner"},
                        "held_elsewhere": {}}


def test_a_claim_never_reported_trained_lapses_and_a_trained_one_does_not(client, make_key, sessions, settings):
    lease, keep = settings.controlplane.claim_lease_s, settings.controlplane.claim_retention_s
    t0 = utcnow()
    with sessions() as s:
        claims.claim(s, "learner", ["held", "done"], [], lease_s=lease, retention_s=keep, now=t0)
        claims.claim(s, "learner", [], ["done"], lease_s=lease, retention_s=keep, now=t0)
        soon = claims.claim(s, "learner-2", ["held", "done"], [], lease_s=lease, retention_s=keep,
                            now=t0 + timedelta(seconds=lease - 1))
        assert soon.granted == [] and soon.held_elsewhere == {"held": "learner"} and \
            soon.trained_elsewhere == {"done": "learner"}
        later = claims.claim(s, "learner-2", ["held", "done"], [], lease_s=lease, retention_s=keep,
                             now=t0 + timedelta(seconds=lease + 1))  # learner died mid-step: "held" lapsed
        assert later.granted == ["held"] and later.trained_elsewhere == {"done": "learner"}
        gone = claims.claim(s, "learner", ["held", "done"], [], lease_s=lease, retention_s=keep,
                            now=t0 + timedelta(seconds=keep + 1))  # past the retention: every claim forgotten
        assert sorted(gone.granted) == ["done", "held"] and not gone.trained_elsewhere and not gone.held_elsewhere
        s.commit()


def test_claims_speak_only_for_their_own_learner_and_reject_bad_bodies(client, make_key, admin):
    a = make_key("learner", node_id="learner")
    r = _claims(client, a, "learner-2", claim=["r1"])
    assert r.status_code == 403 and "learner-2" in r.json()["message"]
    assert _claims(client, make_key("viewer"), "learner", claim=["r1"]).status_code == 403
    r = client.post("/api/v1/learners/learner/claims", headers=a, json={"claim": ["bad id with spaces"]})
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/json")
    r = client.post("/api/v1/learners/learner/claims", headers=a, json={"claim": "r1", "extra": 1})
    assert r.status_code == 422
    assert _claims(client, admin, "learner", claim=["r9"]).json()["granted"] == ["r9"]  # admin on its behalf
