"""GRPO trainer: loss, adapter store, training service."""
