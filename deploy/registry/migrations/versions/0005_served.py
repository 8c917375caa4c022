"""``served``: when each node first served each version (``liverl lineage``'s feedback -> served time).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "served",
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(128), nullable=False),
        sa.Column("first_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["version"], ["versions.version"]),
        sa.PrimaryKeyConstraint("version", "node"),
    )


def downgrade() -> None:
    op.drop_table("served")
