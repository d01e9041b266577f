"""What fits in a GPU's memory (`flywheel.policy.memory`): pure arithmetic, hand-checked."""

from __future__ import annotations

from types import SimpleNamespace

from flywheel.policy.memory import ModelShape, engine_rows, train_rows

SMOLLM2_135M = ModelShape(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3,
                          head_dim=64, vocab=49152)
SHAPE_1_7B = ModelShape(hidden=2048, intermediate=8192, layers=24, heads=32, kv_heads=32,
                        head_dim=64, vocab=49152)


def test_shape_of_a_config_and_its_sizes() -> None:
    config = SimpleNamespace(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                             num_attention_heads=32, num_key_value_heads=32, vocab_size=49152)
    assert ModelShape.of(config) == SHAPE_1_7B  # head_dim from hidden / heads
    # 30 × (576·64·(2·9 + 2·3) + 3·576·1536) + 2·49152·576
    assert SMOLLM2_135M.params() == 162_791_424
    # 2 (k, v) × 24 layers × 32 heads × 64 × 2 bytes
    assert SHAPE_1_7B.kv_bytes_per_token(2) == 196_608


def test_engine_rows_follow_the_budget() -> None:
    tokens = 494
    per_row = 2 * 196_608 * tokens + 12 * 49152 + 8 * 2048 * 2
    assert engine_rows(per_row * 40 + per_row // 2, SHAPE_1_7B, tokens, dtype_bytes=2) == 40
    # 64 GB free, half of it offered: ~160 rows of ~500 tokens for the 1.7B shape.
    assert engine_rows(32e9, SHAPE_1_7B, tokens, dtype_bytes=2) == int(32e9 // per_row) == 164
    assert engine_rows(0, SHAPE_1_7B, tokens, dtype_bytes=2, floor=8) == 8
    assert engine_rows(1e15, SHAPE_1_7B, tokens, dtype_bytes=2, cap=512) == 512
    # Longer rows, fewer of them; the small model's keys/values are 8.5× smaller a token.
    assert engine_rows(32e9, SHAPE_1_7B, 2 * tokens, dtype_bytes=2) < 164
    assert engine_rows(32e9, SMOLLM2_135M, tokens, dtype_bytes=2, cap=4096) > 8 * 164


def test_train_rows_follow_the_budget() -> None:
    h, i, v, layers = 2048, 8192, 49152, 24
    layer_token = 2 * (6 * h + 4 * i) + 24 * h
    per_row = 64 * layers * layer_token + 196_608 * (430 + 64) + 12 * v * 64
    held = 430 * layers * layer_token
    budget = held + 20 * per_row + 1
    assert train_rows(budget, SHAPE_1_7B, prompt_tokens=430, completion_tokens=64,
                      dtype_bytes=2) == 20
    # Less than the prompt's own pass: the floor (the step still runs, one completion a time).
    assert train_rows(held // 2, SHAPE_1_7B, prompt_tokens=430, completion_tokens=64,
                      dtype_bytes=2) == 1
    # Checkpointing keeps one layer's activations, not 24: more rows in the same memory.
    plain = train_rows(40e9, SHAPE_1_7B, prompt_tokens=430, completion_tokens=64, dtype_bytes=2)
    ckpt = train_rows(40e9, SHAPE_1_7B, prompt_tokens=430, completion_tokens=64, dtype_bytes=2,
                      checkpointing=True)
    assert ckpt > 2 * plain > 2
    # fp32 activations take twice the bytes.
    assert train_rows(40e9, SHAPE_1_7B, prompt_tokens=430, completion_tokens=64,
                      dtype_bytes=4) < plain
    assert train_rows(1e15, SHAPE_1_7B, prompt_tokens=430, completion_tokens=64,
                      dtype_bytes=2, cap=64) == 64


def test_train_rows_of_nothing_is_the_cap() -> None:
    """A row that holds nothing (no tokens) is no reason to divide by zero."""
    assert train_rows(1e9, SHAPE_1_7B, prompt_tokens=0, completion_tokens=0,
                      dtype_bytes=4, cap=7) == 7
