"""The control database's schema migrations (servelm/control/schema.py, servelm/control/migrations) on SQLite
and PostgreSQL: the first revision is exactly the schema the code uses, a database made before migrations is
brought to it with nothing lost, a server may refuse to migrate, a newer database is refused, and the
`servelm db` commands."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import MetaData, text

from servelm.control import audit, db, policies, predictions, registry, schema, spec_store
from servelm.control.registry import Registry
from servelm.control.types import State


def _models() -> MetaData:
    """Every table the control code defines, in one MetaData."""
    out = MetaData()
    for m in (registry.metadata, audit.metadata, policies.metadata, predictions.metadata, spec_store.metadata):
        for t in m.tables.values():
            t.to_metadata(out)
    return out


def test_the_listed_revisions_are_the_migrations_folder():
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(schema.MIGRATIONS))
    scripts = ScriptDirectory.from_config(cfg)
    assert [s.revision for s in reversed(list(scripts.walk_revisions()))] == list(schema.REVISIONS)
    assert scripts.get_current_head() == schema.HEAD


def test_the_migrated_schema_is_the_one_the_code_uses(database_url):
    """Alembic's autogenerate finds no difference between the migrated database and the tables the code
    defines: no migration is missing."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    engine = db.open_engine(database_url)
    schema.upgrade(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), _models())
    engine.dispose()
    assert diff == []


def _legacy_database(url: str, tables: list[MetaData]) -> None:
    """A database as servelm made it before it had migrations: each part created its own tables when it
    first opened the database (a server without traffic management has no predictions table)."""
    engine = db.open_engine(url)
    for m in tables:
        m.create_all(engine)
    engine.dispose()


def test_a_database_made_before_migrations_upgrades_with_nothing_lost(database_url, tmp_path):
    _legacy_database(database_url, [registry.metadata, audit.metadata])
    engine = db.open_engine(database_url)
    with engine.begin() as conn:  # what the old code wrote: a version, its audit entry
        conn.execute(registry.models_table.insert().values(name="m", next_version=2, created_at=1.0))
        conn.execute(registry.versions_table.insert().values(
            name="m", version=1, state="REGISTERED", kind="generate", artifact="/a", sha256="0" * 64, source="/s",
            size_bytes=1, created_by="old", created_at=1.0, labels={}, engine={}, golden_prompts=[],
            golden_outputs=[], state_since=1.0))
    a = audit.Audit.__new__(audit.Audit)  # the trail as the old code appended to it
    a.engine = engine
    with db.write(engine) as conn:
        a.append(conn, "old", "register", "m:1", None, {"v": 1})
    assert schema.status(engine)["state"] == "unversioned"
    engine.dispose()

    reg = Registry(database_url, tmp_path / "data")  # what a new server does at start
    assert schema.status(reg.engine) == {"revision": schema.HEAD, "head": schema.HEAD, "state": "current"}
    assert [v.ref for v in reg.versions("m")] == ["m:1"] and reg.audit.verify() == (True, None)
    reg.transition("m", 1, State.VALIDATING, "new")
    assert [e["actor"] for e in reg.audit.entries()] == ["old", "new"] and reg.audit.verify() == (True, None)
    log = predictions.PredictionLog(reg.engine)  # the tables the old database lacked exist now
    log.write(predictions.Prediction(request_id="r", model="m"))
    assert [e["request_id"] for e in log.entries()] == ["r"]
    with pytest.raises(Exception, match="append-only"), db.write(reg.engine) as conn:
        conn.execute(text("UPDATE predictions SET model = 'x'"))
    reg.close()


def test_a_server_may_refuse_to_migrate_and_names_the_command(database_url, tmp_path):
    with pytest.raises(schema.SchemaError, match="servelm db upgrade") as e:
        Registry(database_url, tmp_path / "data", migrate=False)
    assert "empty" in str(e.value)
    engine = db.open_engine(database_url)
    assert schema.upgrade(engine) == (None, schema.HEAD)
    assert schema.upgrade(engine) == (schema.HEAD, schema.HEAD)  # idempotent
    engine.dispose()
    Registry(database_url, tmp_path / "data", migrate=False).close()


def test_a_database_migrated_by_a_newer_servelm_is_refused(database_url, tmp_path):
    engine = db.open_engine(database_url)
    schema.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    for migrate in (True, False):
        with pytest.raises(schema.SchemaError, match="revision 9999.*newer servelm"):
            Registry(database_url, tmp_path / "data", migrate=migrate)


def test_db_commands(database_url, tmp_path, capsys):
    from servelm.entrypoints.cli import main

    args = ["--database-url", database_url]
    assert main(["db", "current", "--json", *args]) == 1
    assert json.loads(capsys.readouterr().out)["state"] == "empty"
    assert main(["db", "upgrade", *args]) == 0
    assert f"upgraded from no revision to {schema.HEAD}" in capsys.readouterr().out
    assert main(["db", "upgrade", *args]) == 0
    assert "already at revision" in capsys.readouterr().out
    assert main(["db", "current", *args]) == 0
    assert "up to date" in capsys.readouterr().out


def test_db_commands_find_the_database_as_the_server_does(tmp_path, capsys, monkeypatch):
    """No URL: the data directory's SQLite file, which `current` does not create; the env var and the config
    file name it as they do for `servelm serve` (CLI > env > file)."""
    from servelm.entrypoints.cli import main

    data = tmp_path / "data"
    assert main(["db", "current", "--data-dir", str(data)]) == 1
    assert "no database yet" in capsys.readouterr().out and not data.exists()
    assert main(["db", "upgrade", "--data-dir", str(data)]) == 0
    assert (data / "registry.db").is_file()
    cfg = tmp_path / "servelm.toml"
    cfg.write_text(f'[server]\ndatabase_url = "sqlite:///{tmp_path / "file.db"}"\n')
    assert main(["db", "upgrade", "--config", str(cfg)]) == 0
    assert "file.db" in capsys.readouterr().out
    monkeypatch.setenv("SERVELM_DATABASE_URL", f"sqlite:///{tmp_path / 'env.db'}")
    assert main(["db", "upgrade", "--config", str(cfg)]) == 0
    assert "env.db" in capsys.readouterr().out
    assert main(["db", "upgrade", "--config", str(cfg), "--database-url", f"sqlite:///{tmp_path / 'cli.db'}"]) == 0
    assert "cli.db" in capsys.readouterr().out


def test_a_bare_postgresql_url_uses_psycopg_3():
    assert db.engine_url("postgresql://u:p@h/d") == "postgresql+psycopg://u:p@h/d"
    assert db.engine_url("postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"
    assert db.engine_url("sqlite:///x.db") == "sqlite:///x.db"
