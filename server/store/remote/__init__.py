"""Stores on object storage: reaching them, reading and publishing, fetch lanes."""
