"""toolsets: registered versions of the agent's own tools

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05 09:00:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0016'
down_revision: str | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('toolsets',
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('kind', sa.Text(), nullable=False),
    sa.Column('config', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('tools', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('protocol_version', sa.Text(), nullable=True),
    sa.Column('protocol_tools', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('digest', sa.Text(), nullable=False),
    sa.Column('registered_by', sa.Text(), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
              nullable=False),
    sa.Column('removed_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('name', 'version', name=op.f('pk_toolsets')))


def downgrade() -> None:
    op.drop_table('toolsets')
