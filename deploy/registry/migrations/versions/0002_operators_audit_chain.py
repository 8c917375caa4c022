"""Operators with hashed tokens and roles; the audit log chained by hash (tamper-evident).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from deploy.registry.tables import audit_hash

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "operators",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("created_by", sa.String(64), nullable=False),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_index("ix_operators_token_hash", "operators", ["token_hash"], unique=True)
    with op.batch_alter_table("audit_log") as batch:
        batch.add_column(sa.Column("prev_hash", sa.String(64), nullable=True))
        batch.add_column(sa.Column("entry_hash", sa.String(64), nullable=True))
    # chain the entries written before this revision, in id order (deploy.registry.tables.audit_hash); offline SQL
    # output (--sql) cannot read rows, so a database upgraded that way starts its chain unverified: say so there
    if op.get_context().as_sql:
        op.execute("-- liverl: audit entries written before 0002 are not chained; run the upgrade online to chain them")
        return

    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, actor, action, version, reason, at FROM audit_log ORDER BY id")).all()
    prev = ""
    for r in rows:
        h = audit_hash(prev, r.actor, r.action, r.version, r.reason, r.at)
        conn.execute(
            sa.text("UPDATE audit_log SET prev_hash = :p, entry_hash = :h WHERE id = :i"),
            {"p": prev, "h": h, "i": r.id},
        )
        prev = h


def downgrade() -> None:
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_column("entry_hash")
        batch.drop_column("prev_hash")
    op.drop_index("ix_operators_token_hash", "operators")
    op.drop_table("operators")
