"""Reading a published dataset: mapped shards, their integrity by block, vectorised gathers,
and the stored views (graphs, mixtures) built on them."""
