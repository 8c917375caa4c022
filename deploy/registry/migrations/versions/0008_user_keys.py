"""``user_keys``: each user's data key, wrapped under the deployment's key-encryption key (``core.shred``); deleting a
row crypto-shreds everything sealed under it. ``erasures``: the "forget a user" requests and how each ended.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "user_keys",
        sa.Column("unit", sa.Text(), nullable=False),
        sa.Column("wrapped", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("unit"),
    )
    op.create_table(
        "erasures",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("unit", sa.Text(), nullable=False),
        sa.Column("requested_by", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("requested_at", sa.Float(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.Column("report", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_erasures_unit", "erasures", ["unit"])


def downgrade() -> None:
    op.drop_index("ix_erasures_unit", table_name="erasures")
    op.drop_table("erasures")
    op.drop_table("user_keys")
