"""Shared-prompt KV helpers on tiny tensors and tiny random models (no weights loaded)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flywheel.policy.kv import kv_cache, left_padded  # noqa: E402
from flywheel.policy.sampling import share_blocker  # noqa: E402


def kv(length: int, fill: float, layers: int = 2) -> list[torch.Tensor]:
    return [torch.full((1, 1, length, 2), fill + j) for j in range(2 * layers)]


def test_left_padded_pads_short_rows_with_masked_zeros() -> None:
    short, long = kv(2, 10.0), kv(3, 20.0)
    cache, mask = left_padded([short, long, short])

    keys = cache.layers[1].keys  # layer 1's keys: the third tensor of each prompt
    assert keys.shape == (3, 1, 3, 2)
    assert keys[:, 0, :, 0].tolist() == [[0, 12, 12], [22, 22, 22], [0, 12, 12]]
    assert cache.layers[1].values[0, 0, :, 0].tolist() == [0, 13, 13]
    assert mask is not None and mask.tolist() == [[0, 1, 1], [1, 1, 1], [0, 1, 1]]
    # The prompts' own tensors are untouched: each is reused by later calls.
    assert short[2].shape == (1, 1, 2, 2) and short[2].eq(12).all()


def test_left_padded_without_padding_has_no_mask() -> None:
    same = kv(4, 1.0)
    cache, mask = left_padded([same, same])
    assert mask is None and cache.get_seq_length() == 4
    assert cache.layers[0].keys.shape == (2, 1, 4, 2)


def test_kv_cache_expands_and_cuts_without_touching_the_source() -> None:
    source = kv(5, 3.0, layers=1)
    cache = kv_cache(source, 4, length=2)
    assert cache.layers[0].keys.shape == (4, 1, 2, 2)
    cache.update(torch.zeros(4, 1, 1, 2), torch.zeros(4, 1, 1, 2), 0)
    assert cache.get_seq_length() == 3 and source[0].shape == (1, 1, 5, 2)
    assert source[0].eq(3).all()


def tiny(config_cls: type, **extra: object) -> object:
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_share_blocker_accepts_plain_decoders_and_names_what_it_refuses() -> None:
    assert share_blocker(tiny(transformers.LlamaConfig)) is None
    assert share_blocker(tiny(transformers.Qwen2Config)) is None  # sliding window off
    assert "sliding" in (share_blocker(tiny(transformers.MistralConfig, sliding_window=16)) or "")
    gemma = share_blocker(tiny(transformers.Gemma2Config, sliding_window=16))
    assert gemma is not None and "sliding_attention" in gemma
    # Cohere scales its logits after the head: the head alone would sample other tokens.
    cohere = share_blocker(tiny(transformers.CohereConfig, logit_scale=0.25))
    assert cohere is not None and "output head" in cohere


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decoding_in_place_samples_what_concatenating_does(temperature: float) -> None:
    """The GPU's in-place cache (`kv.make_room`, room reserved once) against the CPU's
    concatenation: two prompts of different lengths (left padding), rows compacted as units
    end, the same tokens and log-probs (to fp32 rounding: the strided views may round
    differently), and the cache is never copied whole once room is made."""
    from flywheel.policy.base import SamplingParams
    from flywheel.policy.kv import _RoomyLayer
    from flywheel.policy.sampling import encode, sample_rows

    model = tiny(transformers.LlamaConfig)
    prompts = [encode(model, list(range(3, 15))), encode(model, list(range(5, 12)))]
    rows = [prompts[0]] * 3 + [prompts[1]] * 3
    params = SamplingParams(n=3, max_tokens=12, temperature=temperature)
    out = {}
    for in_place in (False, True):
        units = [(0, 3, torch.Generator().manual_seed(1)), (3, 6, torch.Generator().manual_seed(2))]
        with torch.no_grad():
            out[in_place] = sample_rows(model, rows, params, eos_ids={63}, pad_id=0,
                                        units=units, in_place=in_place)
    assert torch.equal(out[False][0], out[True][0])
    assert float((out[False][1] - out[True][1]).abs().max()) <= 1e-5

    from flywheel.policy.kv import make_room

    cache, _ = left_padded([[t.clone() for t in prompts[0].kv]])
    make_room(cache, 4)
    layer = cache.layers[0]
    assert isinstance(layer, _RoomyLayer)
    k = torch.ones(1, 2, 1, 16)
    layer.update(k, k)
    storage = layer.keys.untyped_storage().data_ptr()
    for _ in range(3):  # within the room: written in place, same storage
        layer.update(k, k)
        assert layer.keys.untyped_storage().data_ptr() == storage
    assert layer.keys.shape[-2] == 12 + 4 and bool((layer.keys[..., 12:, :] == 1).all())
