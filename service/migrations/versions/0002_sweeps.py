"""a sweep job's plan, trials and best trial: jobs.sweep

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, so every existing row stays as it was (an ordinary job has no sweep); SQLite
    # adds such a column in place, without copying the table.
    op.add_column("jobs", sa.Column("sweep", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("sweep")
