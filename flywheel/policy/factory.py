"""Build the configured policy engine (imports the heavy engine only when asked)."""

from __future__ import annotations

from flywheel.config import Settings
from flywheel.policy.base import Policy
from flywheel.policy.chat_format import ChatFormat, load_chat_format
from flywheel.policy.model_cache import resolve_model_dir


def make_policy(settings: Settings) -> Policy:
    cfg = settings.rollout
    if cfg.engine == "vllm":
        from flywheel.policy.vllm import VLLMPolicy

        if not cfg.vllm_urls:
            raise ValueError("rollout.engine is 'vllm' but no replica is configured: set "
                             'FLYWHEEL_ROLLOUT__VLLM_URLS=\'["http://vllm-0:8000"]\'')
        return VLLMPolicy(cfg.vllm_urls, model=cfg.vllm_model, policy_name=settings.policy,
                          retention=cfg.max_staleness + 1, timeout_s=cfg.vllm_timeout_s,
                          chat_format=lambda: policy_chat_format(settings))
    from flywheel.policy.cores import CoreShare
    from flywheel.policy.local import LocalPolicy

    cores = settings.stack.cores_dir

    return LocalPolicy(resolve_model_dir(cfg.model_dir), policy_name=settings.policy,
                       prefix_cache_mb=cfg.prefix_cache_mb, chat_template=cfg.chat_template,
                       max_rows=cfg.local_batch_rows, device=cfg.local_device,
                       precision=cfg.local_precision,
                       cores=CoreShare(cores, "policy") if cores else None,
                       prefix_attention=cfg.prefix_attention)


def policy_chat_format(settings: Settings) -> ChatFormat:
    """The configured policy's chat format (loads the tokenizer of `rollout.model_dir`)."""
    cfg = settings.rollout
    return load_chat_format(resolve_model_dir(cfg.model_dir), cfg.chat_template)
