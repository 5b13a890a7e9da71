"""The control-plane schema as servelm created it before it had migrations: registry, audit trail, traffic
records, prediction log and feedback.

Revision ID: 0001
Revises:
Create Date: 2026-05-20

The tables are written out here, not imported from the modules that use them, so this revision stays what it
was when those modules change. Each is created only where it is missing: a database made by a servelm without
migrations (which created tables as each part first opened it, so it may hold some of them) is brought to this
revision without losing anything, and a new one gets them all.
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

meta = sa.MetaData()
sa.Table(
    "models", meta,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("next_version", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)
sa.Table(
    "versions", meta,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("artifact", sa.Text, nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False, index=True),
    sa.Column("source", sa.Text, nullable=False),
    sa.Column("architecture", sa.String(200)),
    sa.Column("dtype", sa.String(64)),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("num_params", sa.BigInteger),
    sa.Column("created_by", sa.String(200), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("labels", sa.JSON, nullable=False),
    sa.Column("engine", sa.JSON, nullable=False),
    sa.Column("golden_prompts", sa.JSON, nullable=False),
    sa.Column("golden_outputs", sa.JSON, nullable=False),
    sa.Column("failure", sa.Text),
    sa.Column("replaces", sa.Integer),
    sa.Column("state_since", sa.Float, nullable=False),
)
sa.Table(
    "deployments", meta,
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("name", sa.String(128)),
    sa.Column("version", sa.Integer),
    sa.Column("record", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)
sa.Table(
    "audit", meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("action", sa.String(100), nullable=False),
    sa.Column("target", sa.String(300), nullable=False),
    sa.Column("before", sa.JSON),
    sa.Column("after", sa.JSON),
    sa.Column("prev_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("hash", sa.Text, nullable=False),
)
sa.Table(
    "traffic_records", meta,
    sa.Column("kind", sa.String(32), primary_key=True),
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("record", sa.JSON, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("updated_by", sa.String(200), nullable=False),
)
predictions = sa.Table(
    "predictions", meta,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("request_id", sa.String(200), nullable=False),
    sa.Column("at", sa.Float, nullable=False, index=True),
    sa.Column("model", sa.String(128), nullable=False),
    sa.Column("version", sa.Integer),
    sa.Column("arm", sa.String(200)),
    sa.Column("key_name", sa.String(200)),
    sa.Column("user", sa.String(200), index=True),
    sa.Column("prompt", sa.Text),
    sa.Column("output", sa.Text),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("latency_s", sa.Float),
    sa.Column("ttft_s", sa.Float),
    sa.Column("finish_reason", sa.String(32)),
    sa.Column("error", sa.Text),
)
sa.Index("predictions_model_at", predictions.c.model, predictions.c.at)
sa.Table(
    "feedback", meta,
    sa.Column("request_id", sa.String(200), primary_key=True),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("score", sa.Float, nullable=False),
)


def upgrade() -> None:
    bind = op.get_bind()
    meta.create_all(bind, checkfirst=True)
    # added to existing databases after the predictions table itself, so an old one may lack it
    op.execute("CREATE INDEX IF NOT EXISTS predictions_request_id ON predictions (request_id)")
    # the prediction log is append-only: rows leave it by retention and erasure (DELETE), never change
    if bind.dialect.name == "sqlite":
        op.execute("CREATE TRIGGER IF NOT EXISTS predictions_append_only BEFORE UPDATE ON predictions "
                   "BEGIN SELECT RAISE(ABORT, 'the prediction log is append-only'); END")
    elif bind.dialect.name == "postgresql":
        op.execute("CREATE OR REPLACE FUNCTION predictions_append_only() RETURNS trigger LANGUAGE plpgsql AS "
                   "$$ BEGIN RAISE EXCEPTION 'the prediction log is append-only'; END $$")
        op.execute("DROP TRIGGER IF EXISTS predictions_append_only ON predictions")  # CREATE OR REPLACE: 14+
        op.execute("CREATE TRIGGER predictions_append_only BEFORE UPDATE ON predictions "
                   "FOR EACH ROW EXECUTE PROCEDURE predictions_append_only()")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS predictions_append_only ON predictions")
        op.execute("DROP FUNCTION IF EXISTS predictions_append_only()")
    meta.drop_all(bind, checkfirst=True)
