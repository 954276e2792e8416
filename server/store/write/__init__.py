"""Writing a dataset: field specs, per-field buffers, shard files, atomic publishing."""
