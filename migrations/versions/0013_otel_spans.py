"""otel spans: what the OTLP receiver took, grouped by the trajectory they make

Revision ID: 0013
Revises: 0008
Create Date: 2026-12-01 21:00:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0013'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('otel_spans',
    sa.Column('trajectory_id', sa.UUID(), nullable=False),
    sa.Column('trace_id', sa.Text(), nullable=False),
    sa.Column('span_id', sa.Text(), nullable=False),
    sa.Column('is_root', sa.Boolean(), nullable=False),
    sa.Column('span', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
              nullable=False),
    sa.PrimaryKeyConstraint('trajectory_id', 'trace_id', 'span_id', name=op.f('pk_otel_spans'))
    )
    op.create_index('ix_otel_spans_trace_id', 'otel_spans', ['trace_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_otel_spans_trace_id', table_name='otel_spans')
    op.drop_table('otel_spans')
