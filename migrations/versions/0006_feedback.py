"""feedback: outcomes and corrections that arrive later; request ids of trajectories

Revision ID: 0006
Revises: 0005
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('feedback',
    sa.Column('seq', sa.BigInteger(), autoincrement=True, nullable=False),
    sa.Column('feedback_id', sa.UUID(), nullable=False),
    sa.Column('trajectory_id', sa.UUID(), nullable=True),
    sa.Column('request_id', sa.Text(), nullable=True),
    sa.Column('record', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('applied_to', sa.UUID(), nullable=True),
    sa.Column('applied_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_feedback')),
    sa.UniqueConstraint('feedback_id', name=op.f('uq_feedback_feedback_id'))
    )
    op.create_index('ix_feedback_applied_to', 'feedback', ['applied_to'], unique=False)
    op.create_index('ix_feedback_pending', 'feedback', ['seq'], unique=False,
                    postgresql_where=sa.text('applied_at IS NULL AND error IS NULL'))
    op.create_table('trajectory_outcomes',
    sa.Column('trajectory_id', sa.UUID(), nullable=False),
    sa.Column('status', sa.Text(), nullable=False),
    sa.Column('is_failure', sa.Boolean(), nullable=False),
    sa.Column('feedback_count', sa.Integer(), nullable=False),
    sa.Column('record', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('trajectory_id', name=op.f('pk_trajectory_outcomes'))
    )
    op.create_index('ix_trajectories_request_id', 'trajectories',
                    [sa.text("((record -> 'metadata') ->> 'request_id')")], unique=False)


def downgrade() -> None:
    op.drop_index('ix_trajectories_request_id', table_name='trajectories')
    op.drop_table('trajectory_outcomes')
    op.drop_index('ix_feedback_pending', table_name='feedback',
                  postgresql_where=sa.text('applied_at IS NULL AND error IS NULL'))
    op.drop_index('ix_feedback_applied_to', table_name='feedback')
    op.drop_table('feedback')
