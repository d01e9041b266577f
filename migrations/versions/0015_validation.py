"""validation split, validation runs per version, validation status, candidate selections

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01 21:00:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('validation_tasks',
    sa.Column('task_id', sa.UUID(), nullable=False),
    sa.Column('stratum', sa.Text(), nullable=False),
    sa.Column('assigned_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
              nullable=False),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.task_id'],
                            name=op.f('fk_validation_tasks_task_id_tasks')),
    sa.PrimaryKeyConstraint('task_id', name=op.f('pk_validation_tasks')))
    op.create_table('validation_runs',
    sa.Column('key', sa.Text(), nullable=False),
    sa.Column('policy', sa.Text(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=True),
    sa.Column('tasks', sa.Integer(), nullable=False),
    sa.Column('samples', sa.Integer(), nullable=False),
    sa.Column('success_rate', sa.Float(), nullable=False),
    sa.Column('reward_mean', sa.Float(), nullable=False),
    sa.Column('seconds', sa.Float(), nullable=False),
    sa.Column('result', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
              nullable=False),
    sa.PrimaryKeyConstraint('key', name=op.f('pk_validation_runs')))
    op.create_index('ix_validation_runs_policy', 'validation_runs', ['policy', 'version'],
                    unique=False)
    op.create_table('validation_status',
    sa.Column('policy', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), nullable=False),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.Column('train_tasks', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('after_version', sa.Integer(), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('policy', name=op.f('pk_validation_status')))
    op.create_table('candidate_selections',
    sa.Column('policy', sa.Text(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('selection', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('policy', 'version', name=op.f('pk_candidate_selections')))


def downgrade() -> None:
    op.drop_table('candidate_selections')
    op.drop_table('validation_status')
    op.drop_index('ix_validation_runs_policy', table_name='validation_runs')
    op.drop_table('validation_runs')
    op.drop_table('validation_tasks')
