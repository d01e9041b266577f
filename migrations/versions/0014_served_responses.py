"""served responses: `POST /v1/responses` answers kept for previous_response_id chaining

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01 20:30:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('served_responses',
    sa.Column('seq', sa.BigInteger(), autoincrement=True, nullable=False),
    sa.Column('response_id', sa.Text(), nullable=False),
    sa.Column('conversation', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('body', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
              nullable=False),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_served_responses')),
    sa.UniqueConstraint('response_id', name=op.f('uq_served_responses_response_id'))
    )


def downgrade() -> None:
    op.drop_table('served_responses')
