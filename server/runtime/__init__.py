"""The process's plumbing: lanes and deadlines of work, logs, metrics, memory given back, the
machine's size, and shared-memory slot rings."""
