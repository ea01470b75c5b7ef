"""Adapter package; the host is imported lazily by its modules."""
