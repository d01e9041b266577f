"""Flywheel: production agent failures → verifiable tasks → GRPO on LoRA → gated promotion.

Importing this package is cheap: no torch, transformers or vllm at import time.
"""

__version__ = "0.1.0"
