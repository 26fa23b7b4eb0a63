"""Alembic migrations of the control-plane database."""
