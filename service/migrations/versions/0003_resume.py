"""a graceful restart resumes its jobs, admission counts memory, readiness writes: the jobs'
resumes, seq_base and resources; the heartbeat table

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing jobs were never resumed and their records are numbered from 0 (server
    # defaults fill them in place); their resources are read from their spec when absent.
    op.add_column("jobs", sa.Column("resumes", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("seq_base", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("resources", sa.JSON(), nullable=True))
    op.create_table(
        "heartbeat",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("heartbeat")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("resources")
        batch.drop_column("seq_base")
        batch.drop_column("resumes")
