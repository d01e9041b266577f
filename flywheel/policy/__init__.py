"""The policy: one interface, two engines (vLLM over HTTP on GPUs; in-process on CPU).

Importing this package imports no torch: engines load lazily.
"""

from flywheel.policy.base import (
    AdapterRef,
    Completion,
    Policy,
    PolicyError,
    SamplingParams,
    served_name,
)

__all__ = ["AdapterRef", "Completion", "Policy", "PolicyError", "SamplingParams",
           "served_name"]
