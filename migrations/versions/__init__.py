"""Alembic revisions (a package so that wheels carry them)."""
