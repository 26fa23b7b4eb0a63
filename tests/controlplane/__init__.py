"""Control-plane tests."""
