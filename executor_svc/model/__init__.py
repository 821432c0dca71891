"""Model definitions that run over packed tokens with a paged KV cache."""
