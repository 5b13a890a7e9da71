"""A version's base: the `name:version` of the generation model a LoRA adapter version runs on (NULL for every
other version, and for every row an older servelm wrote).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # only where it is missing: a database this revision's code created before it had migrations (brought to
    # 0001 by creating what it lacked) may have the column already
    if "base" in {c["name"] for c in sa.inspect(op.get_bind()).get_columns("versions")}:
        return
    with op.batch_alter_table("versions") as batch:  # SQLite alters a table by copying it
        batch.add_column(sa.Column("base", sa.String(300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("base")
