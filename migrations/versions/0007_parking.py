"""parking: dead letters of every consumer, not only ingest

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 10:00:00.000000
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every existing dead letter is ingest's: the server default says so.
    op.add_column('dead_letters', sa.Column('consumer', sa.Text(), server_default=sa.text("'ingest'"), nullable=False))
    op.drop_constraint('uq_dead_letters_position', 'dead_letters', type_='unique')
    op.create_unique_constraint('uq_dead_letters_position', 'dead_letters', ['consumer', 'topic', 'partition', 'offset'])


def downgrade() -> None:
    op.drop_constraint('uq_dead_letters_position', 'dead_letters', type_='unique')
    op.execute("DELETE FROM dead_letters WHERE consumer <> 'ingest'")
    op.create_unique_constraint('uq_dead_letters_position', 'dead_letters', ['topic', 'partition', 'offset'])
    op.drop_column('dead_letters', 'consumer')
