"""Packaged gate policies (default.yaml)."""
