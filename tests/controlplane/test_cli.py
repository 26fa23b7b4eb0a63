"""`adaflash controlplane` is offered by the CLI with its flags."""

from adaflash.cli import build_parser
from controlplane.cli import run


def test_controlplane_command_parses():
    args = build_parser().parse_args(["controlplane", "--host", "0.0.0.0", "--port", "9100"])
    assert args.func is run and args.host == "0.0.0.0" and args.port == 9100


def test_migrate_and_reap_subcommands(tmp_path, monkeypatch, capsys):
    import json
    from datetime import timedelta

    from adaflash.cli import main
    from controlplane import lifecycle
    from controlplane.cli import migrate, reap
    from controlplane.db import make_engine, make_sessionmaker, session_scope, utcnow

    assert build_parser().parse_args(["controlplane", "migrate"]).func is migrate
    assert build_parser().parse_args(["controlplane", "reap"]).func is reap
    monkeypatch.setenv("ADAFLASH_HOME", str(tmp_path))
    monkeypatch.setenv("ADAFLASH_CONTROLPLANE__MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert main(["controlplane", "migrate"]) == 0
    assert json.loads(capsys.readouterr().out)["migrated"] is True
    engine = make_engine(f"sqlite:///{tmp_path / 'controlplane.db'}")
    with session_scope(make_sessionmaker(engine)) as s:
        lifecycle.register_version(s, version="7", target_id="t", source_uri="file:///x", run_id=None,
                                   manifest_sha256=None, lineage={}, created_at=utcnow() - timedelta(hours=100),
                                   candidate_ttl_hours=72, actor="test")
    assert main(["controlplane", "reap"]) == 0
    assert json.loads(capsys.readouterr().out) == {"expired": ["7"]}
    with make_sessionmaker(engine)() as s:
        assert lifecycle.get_version(s, "7").state == "expired"
    engine.dispose()


def test_controlplane_runs_its_workers_beside_the_api(tmp_path, monkeypatch):
    import uvicorn

    from adaflash.cli import main
    from controlplane import worker

    started, stopped = [], []
    monkeypatch.setattr(worker.Workers, "start", lambda self: started.append(self) or self)
    monkeypatch.setattr(worker.Workers, "stop", lambda self, timeout_s=30.0: stopped.append(self))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    monkeypatch.setenv("ADAFLASH_HOME", str(tmp_path))
    monkeypatch.setenv("ADAFLASH_CONTROLPLANE__MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert main(["controlplane", "--port", "0"]) == 0
    assert len(started) == 1 and stopped == started
    assert main(["controlplane", "--no-workers"]) == 0
    assert len(started) == 1
