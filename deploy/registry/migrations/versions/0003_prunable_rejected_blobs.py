"""A rejected version's delta can be pruned (``liverl gc --prune-rejected``): ``versions.blob_key`` becomes nullable.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.alter_column("blob_key", existing_type=sa.String(64), nullable=True)


def downgrade() -> None:
    # a pruned row has no blob to point at: it keeps an empty key (the blob is gone either way)
    op.execute("UPDATE versions SET blob_key = '' WHERE blob_key IS NULL")
    with op.batch_alter_table("versions") as batch:
        batch.alter_column("blob_key", existing_type=sa.String(64), nullable=False)
