"""Deployment specs: each model's desired state (control/spec.py), its generation and the reconciler's last
reported status.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deployment_specs",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("status", sa.JSON, nullable=True),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("updated_by", sa.String(200), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("deployment_specs")
