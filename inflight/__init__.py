"""inflight: an LLM inference server."""
