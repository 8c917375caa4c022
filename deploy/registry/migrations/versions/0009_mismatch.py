"""``mismatch``: each version's sampler/trainer log-prob mismatch on the live generations it served, with and without
routing replay, summed by the learner (``Registry.add_mismatch``) and read by the gate, ``liverl versions`` and the
on-call page.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "mismatch",
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("own_tokens", sa.Integer(), nullable=False),
        sa.Column("own_abs", sa.Float(), nullable=False),
        sa.Column("own_kl", sa.Float(), nullable=False),
        sa.Column("replay_tokens", sa.Integer(), nullable=False),
        sa.Column("replay_abs", sa.Float(), nullable=False),
        sa.Column("replay_kl", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["version"], ["versions.version"]),
        sa.PrimaryKeyConstraint("version"),
    )


def downgrade() -> None:
    op.drop_table("mismatch")
