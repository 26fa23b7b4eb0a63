"""Operator commands over the admin API: ``adaflash versions | nodes | tenants | deletions | audit``.

Tables for people, ``--json`` for scripts. The control plane's URL and the API key are
found as ``adaflash.controlplane_client`` describes (``--url`` and ``$ADAFLASH_TOKEN``
override). A refused call prints the API's message and exits non-zero: 3 for 401/403,
4 for 404, 5 for 409, 6 when the control plane cannot be reached, 2 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

EXIT_AUTH, EXIT_NOT_FOUND, EXIT_CONFLICT, EXIT_UNREACHABLE, EXIT_OTHER = 3, 4, 5, 6, 2


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--url", default=None, help="control-plane base URL (default: the running stack, then config)")
    p.add_argument("--token-file", default=None,
                   help="file holding the API key (default: $ADAFLASH_TOKEN, then $ADAFLASH_HOME/admin-token)")
    p.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    return p


def _leaf(sub, name: str, fn: Callable, help_: str, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, description=help_, parents=[common])
    p.set_defaults(func=_run(fn))
    return p


def register(subparsers: argparse._SubParsersAction) -> None:
    c = _common()
    v = subparsers.add_parser("versions", help="drafter versions: list, show, approve, reject, rollback, pin")
    vs = v.add_subparsers(dest="versions_command", metavar="SUBCOMMAND", required=True)
    p = _leaf(vs, "list", versions_list, "versions, newest first", c)
    p.add_argument("--state", default=None, help="only versions in this state (e.g. awaiting_approval)")
    p.add_argument("--limit", type=int, default=50)
    p = _leaf(vs, "show", versions_show, "one version: state, lineage, gates, approvals, evaluation", c)
    p.add_argument("version")
    p = _leaf(vs, "approve", versions_approve, "approve a version awaiting approval (approver or admin)", c)
    p.add_argument("version")
    p.add_argument("--reason", default="", help="why (recorded with the approval)")
    for name, fn, text in (("reject", versions_reject, "reject a candidate (approver or admin)"),
                           ("rollback", versions_rollback, "take a champion or canary out of service")):
        p = _leaf(vs, name, fn, text, c)
        p.add_argument("version")
        p.add_argument("--reason", required=True, help="why (required, recorded in the audit log)")
    for name, fn, text in (("pin", versions_pin, "hold nodes (all if none named) on this version (admin)"),
                           ("unpin", versions_unpin, "release nodes pinned to this version (admin)")):
        p = _leaf(vs, name, fn, text, c)
        p.add_argument("version")
        p.add_argument("--node", action="append", default=[], help="a node id (repeat; none: every node)")
        p.add_argument("--reason", required=True, help="why (required, recorded in the audit log)")

    n = subparsers.add_parser("nodes", help="serving nodes and the versions they serve")
    ns = n.add_subparsers(dest="nodes_command", metavar="SUBCOMMAND", required=True)
    _leaf(ns, "list", nodes_list, "every node: role, served and desired version, live tau", c)

    t = subparsers.add_parser("tenants", help="tenant policies and their audit trail")
    ts = t.add_subparsers(dest="tenants_command", metavar="SUBCOMMAND", required=True)
    _leaf(ts, "list", tenants_list, "stored tenant policies", c)
    p = _leaf(ts, "policy", tenants_policy, "show a tenant's policy, or change it with the flags (admin)", c)
    p.add_argument("tenant")
    p.add_argument("--sampling-rate", type=float, default=None)
    p.add_argument("--opt-out", dest="opt_out", action="store_const", const=True, default=None)
    p.add_argument("--opt-in", dest="opt_out", action="store_const", const=False)
    p.add_argument("--ttl-days", type=float, default=None)
    p.add_argument("--share-cap", type=float, default=None)
    p = _leaf(ts, "audit", tenants_audit, "a tenant's audit trail", c)
    p.add_argument("tenant")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--after-seq", type=int, default=0)

    d = subparsers.add_parser("deletions", help="deletion requests: ask for a tenant's data to be purged")
    ds = d.add_subparsers(dest="deletions_command", metavar="SUBCOMMAND", required=True)
    p = _leaf(ds, "request", deletions_request, "purge a tenant's data (or some requests/records) (admin)", c)
    p.add_argument("tenant")
    p.add_argument("--reason", required=True, help="why (required, recorded in the audit log)")
    p.add_argument("--scope", choices=["tenant", "requests", "records"], default="tenant")
    p.add_argument("--id", dest="ids", action="append", default=[], help="request or record id (repeat)")
    p = _leaf(ds, "status", deletions_status, "one deletion request's per-component status (none: list)", c)
    p.add_argument("request_id", nargs="?", type=int, default=None)

    h = subparsers.add_parser("hold", help="pause online training and shadow evaluation (serving goes on)")
    hs = h.add_subparsers(dest="hold_command", metavar="SUBCOMMAND", required=True)
    _leaf(hs, "show", hold_show, "the learning hold and whether it has taken effect", c)
    p = _leaf(hs, "set", hold_set, "hold learning and/or evaluation across the fleet (admin)", c)
    p.add_argument("--learning", action="store_true", help="learners take no step")
    p.add_argument("--evaluation", action="store_true", help="no new shadow evaluation starts")
    p.add_argument("--reason", required=True, help="why (required, recorded in the audit log)")
    p.add_argument("--wait", type=float, default=0.0,
                   help="seconds to wait until the hold has taken effect (exit 5 if it has not)")
    p = _leaf(hs, "lift", hold_lift, "resume learning and evaluation (admin)", c)
    p.add_argument("--reason", required=True, help="why (required, recorded in the audit log)")

    a = subparsers.add_parser("audit", help="the hash-chained audit log")
    as_ = a.add_subparsers(dest="audit_command", metavar="SUBCOMMAND", required=True)
    _leaf(as_, "verify", audit_verify, "recompute the audit log's hash chain (exit 1 if broken)", c)


def _run(fn: Callable) -> Callable:
    """Open a client, call ``fn(client, args)``, turn API errors into a message and an exit status."""

    def run(args: argparse.Namespace, settings) -> int:
        from adaflash.controlplane_client import (
            ControlPlaneClient,
            ControlPlaneError,
            ControlPlaneUnreachable,
            resolve_token,
            resolve_url,
        )

        try:
            token = _read(args.token_file) if args.token_file else resolve_token(settings)
            with ControlPlaneClient(resolve_url(settings, args.url), token) as client:
                return int(fn(client, args) or 0)
        except ControlPlaneUnreachable as e:
            print(f"adaflash: error: {e.message}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except ControlPlaneError as e:
            status = f" (HTTP {e.status}, {e.code})" if e.status else ""
            print(f"adaflash: error: {e.message}{status}", file=sys.stderr)
            return {401: EXIT_AUTH, 403: EXIT_AUTH, 404: EXIT_NOT_FOUND, 409: EXIT_CONFLICT}.get(e.status, EXIT_OTHER)
        except ValueError as e:  # a body the contract refuses before it is sent (pydantic)
            print(f"adaflash: error: {e}", file=sys.stderr)
            return EXIT_OTHER

    return run


def _read(path: str) -> str:
    from adaflash.cli import CliError
    from adaflash.credentials import read_file

    try:
        token = read_file(path)
    except OSError as e:
        raise CliError(f"cannot read the token file {path}: {e}") from e
    if not token:
        raise CliError(f"the token file {path} is missing or empty")
    return token


# -- output -------------------------------------------------------------------------------------------------
def _emit_json(data: Any) -> None:
    from pydantic import BaseModel

    def dump(x):
        return x.model_dump(mode="json") if isinstance(x, BaseModel) else x

    print(json.dumps([dump(x) for x in data] if isinstance(data, list) else dump(data), indent=2))


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*["" if x is None else str(x) for x in r])
    Console().print(t)


def _when(dt) -> str:
    return dt.strftime("%Y-%m-%d %H:%M:%S") if dt else ""


def _num(x: float | None, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


# -- versions -------------------------------------------------------------------------------------------------
def versions_list(client, args) -> int:
    rows = client.list_versions(state=args.state, limit=args.limit)
    if args.json:
        _emit_json(rows)
        return 0
    _table("versions", ["version", "state", "aliases", "created", "reason"],
           [[v.version, v.state, ",".join(v.aliases), _when(v.created_at), v.state_reason] for v in rows])
    return 0


def _print_detail(client, d) -> None:
    from rich.console import Console

    con = Console()
    con.print(f"[bold]version {d.version}[/bold]  state [bold]{d.state}[/bold]"
              + (f"  aliases {','.join(d.aliases)}" if d.aliases else ""))
    if d.state_reason:
        con.print(f"reason: {d.state_reason}")
    lin = d.lineage or {}
    con.print(f"target {d.target_id}; parent {lin.get('parent_version')}; tenants {lin.get('tenants')}; "
              f"source {lin.get('source')}; window {lin.get('window_start')} .. {lin.get('window_end')}")
    if d.gate_results:
        _table("gates", ["gate", "passed", "value", "threshold", "reason"],
               [[g.name, "yes" if g.passed else "NO", _num(g.value), _num(g.threshold), g.reason]
                for g in d.gate_results])
    if d.evaluation_ids:
        ev = client.get_evaluation(d.evaluation_ids[-1])
        rep = ev.report or {}
        cand, champ = rep.get("candidate") or {}, rep.get("champion") or {}
        con.print(f"evaluation {ev.id} ({ev.status}): candidate tau {_num(cand.get('tau'))} vs "
                  f"{'champion ' + str(rep.get('champion_version')) if champ else 'plain decoding'} "
                  f"tau {_num(champ.get('tau')) if champ else '1.000'} on {rep.get('n_records')} records; "
                  f"plots: {', '.join(ev.plots)}")
    if d.approvals:
        _table("approvals", ["decision", "by", "reason", "at"],
               [[a.decision, a.actor, a.reason, _when(a.created_at)] for a in d.approvals])
    if d.promotions:
        _table("promotions", ["id", "kind", "state", "from", "reason"],
               [[p.id, p.kind, p.state, p.from_version, p.reason] for p in d.promotions])


def versions_show(client, args) -> int:
    d = client.get_version(args.version)
    if args.json:
        _emit_json(d)
    else:
        _print_detail(client, d)
    return 0


def _after_action(client, args, detail, verb: str) -> int:
    if args.json:
        _emit_json(detail)
    else:
        print(f"{verb} {args.version}: state now {detail.state}")
    return 0


def versions_approve(client, args) -> int:
    return _after_action(client, args, client.approve(args.version, args.reason), "approved")


def versions_reject(client, args) -> int:
    return _after_action(client, args, client.reject(args.version, args.reason), "rejected")


def versions_rollback(client, args) -> int:
    p = client.rollback(args.version, args.reason)
    if args.json:
        _emit_json(p)
    else:
        print(f"rollback of {args.version} started: promotion {p.id} ({p.state}), back to {p.from_version}")
    return 0


def versions_pin(client, args) -> int:
    out = client.pin(args.version, args.reason, args.node)
    if args.json:
        _emit_json(out)
    else:
        print(f"pinned to {out.version}: {', '.join(out.nodes) or '(no node)'}")
    return 0


def versions_unpin(client, args) -> int:
    out = client.unpin(args.version, args.reason, args.node)
    if args.json:
        _emit_json(out)
    else:
        print(f"released from {out.version}: {', '.join(out.nodes) or '(no node)'}")
    return 0


# -- nodes, tenants ---------------------------------------------------------------------------------------------
def nodes_list(client, args) -> int:
    rows = client.list_nodes()
    if args.json:
        _emit_json(rows)
        return 0
    _table("nodes", ["node", "role", "served", "desired", "pinned", "live tau", "TPS", "status", "stale"],
           [[n.node_id, n.role, n.served_version, n.desired_version, n.pinned_version, _num(n.live_tau),
             _num(n.live_tps, 1), n.status, "yes" if n.stale else ""] for n in rows])
    return 0


def _policy_rows(policies) -> list[list[Any]]:
    return [[p.tenant_id, p.sampling_rate, "yes" if p.opt_out else "no", p.ttl_days, p.share_cap] for p in policies]


POLICY_COLUMNS = ["tenant", "sampling rate", "opt-out", "TTL days", "share cap"]


def tenants_list(client, args) -> int:
    rows = client.list_tenants()
    if args.json:
        _emit_json(rows)
    else:
        _table("tenants", POLICY_COLUMNS, _policy_rows(rows))
    return 0


def tenants_policy(client, args) -> int:
    changes = {k: getattr(args, k) for k in ("sampling_rate", "opt_out", "ttl_days", "share_cap")
               if getattr(args, k) is not None}
    policy = client.set_tenant_policy(args.tenant, **changes) if changes else client.get_tenant_policy(args.tenant)
    if args.json:
        _emit_json(policy)
    else:
        _table(f"tenant {args.tenant}" + (" (updated)" if changes else ""), POLICY_COLUMNS, _policy_rows([policy]))
    return 0


def _audit_rows(entries) -> list[list[Any]]:
    return [[e.seq, _when(e.at), e.actor, e.action, e.target, json.dumps(e.after)[:80] if e.after else ""]
            for e in entries]


def tenants_audit(client, args) -> int:
    rows = client.audit(tenant_id=args.tenant, after_seq=args.after_seq, limit=args.limit)
    if args.json:
        _emit_json(rows)
    else:
        _table(f"audit trail of tenant {args.tenant}", ["seq", "at", "actor", "action", "target", "after"],
               _audit_rows(rows))
    return 0


# -- deletions, audit --------------------------------------------------------------------------------------------
def _deletion_rows(rows) -> list[list[Any]]:
    return [[r.id, r.tenant_id, r.scope.value, r.state.value, r.requested_by, ", ".join(r.waiting_for),
             _when(r.complete_by) + (" (provisional)" if r.provisional else ""), r.reason] for r in rows]


DELETION_COLUMNS = ["id", "tenant", "scope", "state", "by", "waiting for", "all copies gone by", "reason"]


def deletions_request(client, args) -> int:
    r = client.request_deletion(args.tenant, args.reason, scope=args.scope, ids=args.ids)
    if args.json:
        _emit_json(r)
    else:
        _table(f"deletion request {r.id}", DELETION_COLUMNS, _deletion_rows([r]))
    return 0


def deletions_status(client, args) -> int:
    rows = [client.get_deletion(args.request_id)] if args.request_id is not None else client.list_deletions()
    if args.json:
        _emit_json(rows[0] if args.request_id is not None else rows)
    else:
        _table("deletion requests", DELETION_COLUMNS, _deletion_rows(rows))
    return 0


def audit_verify(client, args) -> int:
    r = client.verify_audit()
    if args.json:
        _emit_json(r)
    elif r.ok:
        print(f"audit chain intact: {r.entries} entries")
    else:
        print(f"audit chain BROKEN at seq {r.first_bad_seq}: {r.reason} ({r.entries} entries)")
    return 0 if r.ok else 1


# -- the learning hold -------------------------------------------------------------------------------------------
def _print_hold(h) -> None:
    held = [x for x, on in (("learning", h.learning), ("evaluation", h.evaluation)) if on]
    print(f"held: {', '.join(held) or 'nothing'}" + (f" (by {h.set_by} at {_when(h.set_at)}: {h.reason})"
                                                       if h.set_at else ""))
    print(f"taken effect: {'yes' if h.quiet else 'not yet'}" +
          (f"; under evaluation: {', '.join(h.evaluating)}" if h.evaluating else ""))
    if h.learners:
        _table("learners", ["learner", "last read the hold", "quiet"],
               [[x.learner_id, _when(x.seen_at), "yes" if x.quiet else ""] for x in h.learners])


def _show_hold(h, args) -> int:
    if args.json:
        _emit_json(h)
    else:
        _print_hold(h)
    return 0


def hold_show(client, args) -> int:
    return _show_hold(client.get_hold(), args)


def hold_set(client, args) -> int:
    import time

    if not (args.learning or args.evaluation):
        print("adaflash: error: name what to hold (--learning, --evaluation); `adaflash hold lift` resumes",
              file=sys.stderr)
        return EXIT_OTHER
    h = client.set_hold(args.learning, args.evaluation, args.reason)
    deadline = time.monotonic() + args.wait
    while not h.quiet and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        h = client.get_hold()
    _show_hold(h, args)
    return 0 if h.quiet or not args.wait else EXIT_CONFLICT


def hold_lift(client, args) -> int:
    return _show_hold(client.set_hold(False, False, args.reason), args)
