"""Rollouts in the registry (compare-and-set by revision) and the audit log keyed: ``seq`` and ``mac`` per entry.

Existing entries get their position as ``seq`` and no ``mac``: ``liverl history --verify`` reports them as unkeyed
(chained by hash only), and the first keyed entry written after this revision seals them into the keyed chain.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), nullable=False, autoincrement=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("checksum", sa.String(64), nullable=False),
        sa.Column("stable_version", sa.Integer(), nullable=False),
        sa.Column("share", sa.Float(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("unit", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("deadline_at", sa.Float(), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("test_state", sa.JSON(), nullable=False),
        sa.Column("looks", sa.JSON(), nullable=False),
        sa.Column("verdict", sa.String(32), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["version"], ["versions.version"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_rollouts_version", "rollouts", ["version"])
    op.create_index("ix_rollouts_state", "rollouts", ["state"])
    with op.batch_alter_table("audit_log") as batch:
        batch.add_column(sa.Column("seq", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("mac", sa.String(64), nullable=True))
    # number the entries written before this revision, in id order; offline SQL (--sql) cannot read rows: their seq
    # stays NULL, which verification accepts for unkeyed entries (the next entry then takes the count + 1)
    if op.get_context().as_sql:
        op.execute(
            "-- liverl: audit entries written before 0004 are not numbered; run the upgrade online to number them"
        )
    else:
        conn = op.get_bind()
        ids = conn.execute(sa.text("SELECT id FROM audit_log ORDER BY id")).scalars().all()
        if ids:
            conn.execute(
                sa.text("UPDATE audit_log SET seq = :s WHERE id = :i"), [{"s": n, "i": i} for n, i in enumerate(ids, 1)]
            )
    op.create_index("ix_audit_log_seq", "audit_log", ["seq"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_audit_log_seq", "audit_log")
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_column("mac")
        batch.drop_column("seq")
    op.drop_index("ix_rollouts_state", "rollouts")
    op.drop_index("ix_rollouts_version", "rollouts")
    op.drop_table("rollouts")
