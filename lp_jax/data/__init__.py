"""Training data: tokenizers, token shards (``prepare_data`` writes them) and the grain
pipeline that packs them into batches."""
