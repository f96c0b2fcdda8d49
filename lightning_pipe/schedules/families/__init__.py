"""One module per schedule family: each turns stages and micro-batches into per-rank action lists."""
