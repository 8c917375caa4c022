"""The initial registry schema: exactly what ``Base.metadata.create_all`` made before migrations existed.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "versions",
        sa.Column("version", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("promoted_at", sa.Float(), nullable=True),
        sa.Column("checksum", sa.String(64), nullable=False),
        sa.Column("blob_key", sa.String(64), nullable=False),
        sa.Column("blob_kind", sa.String(8), nullable=False),
        sa.Column("snapshot_key", sa.String(64), nullable=True),
        sa.Column("snapshot_base", sa.Integer(), nullable=False),
        sa.Column("chain_depth", sa.Integer(), nullable=False),
        sa.Column("raw_bytes", sa.BigInteger(), nullable=False),
        sa.Column("delta_bytes", sa.BigInteger(), nullable=True),
        sa.Column("snapshot_bytes", sa.BigInteger(), nullable=True),
        sa.Column("ratio", sa.Float(), nullable=True),
        sa.Column("changed_fraction", sa.Float(), nullable=True),
        sa.Column("learner_step", sa.Integer(), nullable=True),
        sa.Column("model_dir", sa.Text(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("sample_offsets", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["parent"], ["versions.version"]),
        sa.PrimaryKeyConstraint("version"),
    )
    op.create_index("ix_versions_parent", "versions", ["parent"])
    op.create_index("ix_versions_status", "versions", ["status"])

    op.create_table(
        "gate_results",
        sa.Column("id", sa.Integer(), nullable=False, autoincrement=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("check", sa.String(64), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("threshold", sa.Float(), nullable=True),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["version"], ["versions.version"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_gate_results_version", "gate_results", ["version"])

    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), nullable=False, autoincrement=True),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_audit_log_version", "audit_log", ["version"])

    op.create_table(
        "fleet",
        sa.Column("node", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("checksum", sa.String(64), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("node"),
    )

    op.create_table(
        "counters",
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("counters")
    op.drop_table("fleet")
    op.drop_index("ix_audit_log_version", table_name="audit_log")
    op.drop_table("audit_log")
    op.drop_index("ix_gate_results_version", table_name="gate_results")
    op.drop_table("gate_results")
    op.drop_index("ix_versions_status", table_name="versions")
    op.drop_index("ix_versions_parent", table_name="versions")
    op.drop_table("versions")
