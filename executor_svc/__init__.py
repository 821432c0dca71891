"""Executor service: runs the model over packed batches and samples next tokens."""
