"""Persistence every stage shares: atomic file writes and the on-disk analysis cache."""
