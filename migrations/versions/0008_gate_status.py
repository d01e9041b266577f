"""gate status: the gate's progress (evaluation or baseline in progress) and eval-set power

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 11:00:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('gate_status',
    sa.Column('policy', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=True),
    sa.Column('baseline_version', sa.Integer(), nullable=True),
    sa.Column('eval_set_version', sa.Integer(), nullable=True),
    sa.Column('round', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('rounds_planned', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('samples_done', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('samples_planned', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.Column('power', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.PrimaryKeyConstraint('policy', name=op.f('pk_gate_status'))
    )


def downgrade() -> None:
    op.drop_table('gate_status')
