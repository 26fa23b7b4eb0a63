"""The console in a real headless Chromium, against a real control plane.

An approver logs in with an API key, opens the candidate awaiting approval, sees its
plots load, approves with a reason, and the promotion shows in the version's state; a
viewer finds Approve disabled and a forged post refused; an auditor sees only their
tenant. Debian's chromium (/usr/bin/chromium) driven by Playwright's Python package.

Set ADAFLASH_CONSOLE_SCREENSHOTS=DIR to keep a PNG of each page (docs/console/ holds them).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.controlplane.approval_stack import candidate_awaiting_approval

pytestmark = pytest.mark.services
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no {CHROMIUM}: `make setup` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def console(tmp_path_factory, real_target_dir):
    with candidate_awaiting_approval(tmp_path_factory.mktemp("console"), real_target_dir) as (st, version, admin):
        st.keys = {role: admin.create_key(f"console-{role}", role).key for role in ("viewer", "approver")}
        st.keys["auditor"] = admin.create_key("console-auditor", "auditor", tenants=["acme"]).key
        st.keys["admin"] = st.admin_token
        admin.set_tenant_policy("acme", sampling_rate=0.5)
        admin.set_tenant_policy("globex", opt_out=True)
        yield st, version


def shoot(page, name: str, tmp_path: Path) -> None:
    """A full-page PNG under tmp_path, and a 128-colour copy under $ADAFLASH_CONSOLE_SCREENSHOTS when set."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    keep = os.environ.get("ADAFLASH_CONSOLE_SCREENSHOTS")
    if keep:
        from PIL import Image

        Path(keep).mkdir(parents=True, exist_ok=True)
        small = Image.open(path).convert("RGB").quantize(colors=128, dither=Image.Dither.NONE)
        small.save(Path(keep) / f"{name}.png", optimize=True)


def login(browser, st, role: str):
    ctx = browser.new_context(viewport={"width": 1360, "height": 900})
    page = ctx.new_page()
    page.goto(f"{st.cp.url}/console")
    assert page.url.endswith("/console/login")
    page.fill("#api_key", st.keys[role])
    page.click("button[type=submit]")
    page.wait_for_load_state()
    return ctx, page


def test_approver_approves_a_candidate_with_its_plots(browser, console, tmp_path):
    st, v = console
    ctx, page = login(browser, st, "approver")
    assert "/console/versions" in page.url and page.locator("h1").inner_text() == "Drafter versions"
    # the key lives only in the HTTP-only session cookie, encrypted; nothing in web storage
    cookies = ctx.cookies()
    assert [c["httpOnly"] for c in cookies] == [True] and st.keys["approver"] not in cookies[0]["value"]
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0
    assert st.keys["approver"] not in page.content()
    shoot(page, "versions", tmp_path)

    plot_status: dict[str, int] = {}
    page.on("response", lambda r: plot_status.__setitem__(r.url, r.status) if "/plots/" in r.url else None)
    page.click(f"a[href='/console/versions/{v}']")
    page.wait_for_load_state("networkidle")
    assert page.locator("#version-state").inner_text() == "awaiting approval"
    imgs = page.locator(".plots img")
    assert imgs.count() == 4
    widths = page.evaluate("Array.from(document.querySelectorAll('.plots img')).map(i => [i.alt, i.naturalWidth])")
    assert all(w > 0 for _, w in widths), widths
    assert {"tau per tenant", "tau per domain"} <= {alt for alt, _ in widths}
    assert len(plot_status) == 4 and set(plot_status.values()) == {200}, plot_status
    report = page.locator("#report").inner_text()
    assert "acme" in report and "globex" in report and "chat" in report and "code" in report
    assert "Predicted against live tau" in report
    shoot(page, "version-awaiting-approval", tmp_path)

    assert page.locator("#approve").is_enabled()
    page.fill("#reason", "tau up on both tenants (OPS-42)")
    page.click("#approve")
    page.wait_for_load_state()
    assert "Approved" in page.locator(".notice").inner_text()
    assert page.locator("#version-state").inner_text() in ("approved", "canary", "champion")
    st.drive(lambda: st.state(v) == "champion", what="approved candidate promoted")
    page.reload()
    assert page.locator("#version-state").inner_text() == "champion"
    body = page.locator("main").inner_text()
    assert "tau up on both tenants (OPS-42)" in body and "completed" in body
    shoot(page, "version-champion", tmp_path)
    approvals = [a for a in st.admin.audit(action="version.approved") if a.target == f"version:{v}"]
    assert len(approvals) == 1 and "console-approver" in approvals[0].actor
    ctx.close()


def test_viewer_sees_approve_disabled_and_a_forged_post_is_refused(browser, console, tmp_path):
    st, _ = console
    v = st.publish(seed=5)
    st.drive(lambda: st.state(v) == "awaiting_approval", what="second candidate evaluated")
    ctx, page = login(browser, st, "viewer")
    page.goto(f"{st.cp.url}/console/versions/{v}")
    assert page.locator("#version-state").inner_text() == "awaiting approval"
    assert page.locator("#approve").is_disabled() and page.locator("#reject").is_disabled()
    assert page.locator("#pin").is_disabled()
    shoot(page, "version-as-viewer", tmp_path)
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    url = f"{st.cp.url}/console/versions/{v}/approve"
    refused = page.request.post(url, form={"csrf": csrf, "reason": "sneaky"})
    assert refused.status == 403 and "role viewer may not do this" in refused.text()
    ctx.close()

    # An approver's session without the CSRF token (or from another origin) is refused too.
    ctx, page = login(browser, st, "approver")
    assert page.request.post(url, form={"reason": "no token"}).status == 422
    assert page.request.post(url, form={"csrf": "0" * 32, "reason": "wrong token"}).status == 403
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    forged = page.request.post(url, form={"csrf": csrf, "reason": "x"}, headers={"Origin": "http://evil.example"})
    assert forged.status == 403 and "cross-site" in forged.text()
    assert st.state(v) == "awaiting_approval"
    ctx.close()


def test_pages_for_nodes_tenants_deletions_and_audit(browser, console, tmp_path):
    st, _ = console
    ctx, page = login(browser, st, "admin")
    page.goto(f"{st.cp.url}/console/nodes")
    row = page.locator("tr", has_text="node-a").inner_text()
    assert re.search(r"node-a", row) and "ready" in row
    shoot(page, "nodes", tmp_path)
    page.goto(f"{st.cp.url}/console/tenants")
    assert "opted out" in page.locator("tr", has_text="globex").inner_text()
    shoot(page, "tenants", tmp_path)
    page.goto(f"{st.cp.url}/console/tenants/acme")
    page.fill("input[name=share_cap]", "0.3")
    page.click("#save-policy")
    page.wait_for_load_state()
    assert "stored" in page.locator(".notice").inner_text()
    assert st.admin.get_tenant_policy("acme").share_cap == 0.3
    assert "tenant.policy" in page.locator(".audit").inner_text()
    shoot(page, "tenant", tmp_path)
    page.goto(f"{st.cp.url}/console/deletions")
    page.fill("input[name=tenant_id]", "globex")
    page.fill("form.policy input[name=reason]", "customer asked (GDPR-9)")
    page.once("dialog", lambda d: d.accept())
    page.click("form.policy button[type=submit]")
    page.wait_for_load_state()
    assert "GDPR-9" in page.locator("table.grid").inner_text()
    assert "intact" in page.locator("#audit-chain").inner_text()
    shoot(page, "deletions", tmp_path)
    page.goto(f"{st.cp.url}/console/audit")
    assert "deletion" in page.locator(".audit").inner_text()
    shoot(page, "audit", tmp_path)
    ctx.close()


def store_hold(page, held: bool, reason: str) -> None:
    """Tick (or untick) both hold boxes on the nodes page and store the hold with ``reason``."""
    for box in ("learning", "evaluation"):
        page.set_checked(f"#hold input[name={box}]", held)
    page.fill("#hold input[name=reason]", reason)
    page.click("#save-hold")
    page.wait_for_load_state()


def test_admin_holds_learning_from_the_nodes_page_and_a_viewer_cannot(browser, console, tmp_path):
    st, _ = console
    ctx, page = login(browser, st, "viewer")
    page.goto(f"{st.cp.url}/console/nodes")
    assert "nothing held" in page.locator("#hold").inner_text()
    assert page.locator("#save-hold").is_disabled()
    ctx.close()
    ctx, page = login(browser, st, "admin")
    page.goto(f"{st.cp.url}/console/nodes")
    store_hold(page, True, "load test (OPS-77)")
    assert "Learning hold stored" in page.locator(".notice").inner_text()
    text = page.locator("#hold").inner_text()
    assert "held: learning, evaluation" in text and "OPS-77" in text
    h = st.admin.get_hold()
    assert h.learning and h.evaluation and h.reason == "load test (OPS-77)"
    shoot(page, "hold", tmp_path)
    store_hold(page, False, "load test done")
    assert "nothing held" in page.locator("#hold").inner_text()
    assert not st.admin.get_hold().learning
    ctx.close()


def test_auditor_sees_only_their_tenant(browser, console):
    st, v = console
    ctx, page = login(browser, st, "auditor")
    assert page.url.endswith("/console/tenants")
    tenants = page.locator("table.grid tbody").inner_text()
    assert "acme" in tenants and "globex" not in tenants
    assert page.goto(f"{st.cp.url}/console/tenants/globex").status == 403
    assert page.goto(f"{st.cp.url}/console/versions/{v}").status == 403
    page.goto(f"{st.cp.url}/console/tenants/acme")
    trail = page.locator(".audit").inner_text()
    assert "tenant.policy" in trail
    ctx.close()


def test_bad_key_and_logout(browser, console, tmp_path):
    st, _ = console
    st.keys["bogus"] = "adf_0000_not-a-key"
    ctx, page = login(browser, st, "bogus")
    assert page.url.endswith("/console/login") and page.locator(".error").is_visible()
    shoot(page, "login-refused", tmp_path)
    assert ctx.cookies() and page.goto(f"{st.cp.url}/console/versions").url.endswith("/console/login?next=/console/versions")
    ctx.close()
    ctx, page = login(browser, st, "viewer")
    page.click("text=Log out")
    page.wait_for_load_state()
    assert page.url.endswith("/console/login?done=logged_out")
    assert page.goto(f"{st.cp.url}/console/nodes").url.endswith("/console/login?next=/console/nodes")
    ctx.close()
