"""The local engine's prefix cache as pure logic: longest shared start, LRU under a byte cap,
entries per adapter."""

from __future__ import annotations

import pytest

from flywheel.policy.prefix_cache import PrefixCache, common_prefix_len


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_len([5], [1]) == 0
    assert common_prefix_len([], [1]) == 0


def test_lookup_finds_the_longest_shared_start_of_that_adapter() -> None:
    cache: PrefixCache[str] = PrefixCache(100)
    cache.put(None, [1, 2, 3, 4], "sys+a", 10)
    cache.put(None, [1, 2, 9], "sys+b", 10)
    cache.put("p@v1", [1, 2, 3, 4, 5], "adapter", 10)

    hit = cache.lookup(None, [1, 2, 3, 7, 7])
    assert hit is not None and (hit.value, hit.shared, hit.exact) == ("sys+a", 3, False)
    hit = cache.lookup(None, [1, 2, 3, 4])
    assert hit is not None and (hit.value, hit.shared, hit.exact) == ("sys+a", 4, True)
    # The prompt is a strict start of an entry: shared = the whole prompt, yet not exact.
    hit = cache.lookup("p@v1", [1, 2, 3])
    assert hit is not None and (hit.value, hit.shared, hit.exact) == ("adapter", 3, False)
    assert cache.lookup("p@v2", [1, 2, 3, 4]) is None  # another adapter's weights: no reuse
    assert cache.lookup(None, [1, 2, 3, 7], minimum=4) is None
    assert (cache.hits, cache.misses) == (3, 2)


def test_least_recently_used_goes_first_under_the_cap() -> None:
    cache: PrefixCache[str] = PrefixCache(30)
    for name, ids in (("a", [1]), ("b", [2]), ("c", [3])):
        assert cache.put(None, ids, name, 10)
    assert cache.lookup(None, [1]) is not None  # a is now the most recent
    assert cache.put(None, [4], "d", 15)  # needs 15 of 30: b, then c, go (a was touched)

    assert len(cache) == 2 and cache.nbytes == 25
    assert cache.lookup(None, [2]) is None and cache.lookup(None, [3]) is None
    assert [cache.lookup(None, [i]) is not None for i in (1, 4)] == [True, True]


def test_oversized_entries_replacement_and_disabled_cache() -> None:
    cache: PrefixCache[str] = PrefixCache(20)
    assert cache.put(None, [1], "a", 12)
    assert not cache.put(None, [2], "huge", 21)  # larger than the whole cache: not kept
    assert len(cache) == 1 and cache.nbytes == 12
    assert cache.put(None, [1], "a again", 5)  # the same key replaces, bytes recounted
    assert cache.nbytes == 5
    hit = cache.lookup(None, [1])
    assert hit is not None and hit.value == "a again"

    off: PrefixCache[str] = PrefixCache(0)
    assert not off.put(None, [1], "a", 1)
    assert off.lookup(None, [1]) is None and len(off) == 0
    with pytest.raises(ValueError, match="≥ 0"):
        PrefixCache(-1)


def test_dropping_an_adapter_forgets_only_its_entries() -> None:
    cache: PrefixCache[str] = PrefixCache(100)
    cache.put("p@v1", [1, 2], "v1", 10)
    cache.put("p@v1", [1, 3], "v1b", 10)
    cache.put("p@v2", [1, 2], "v2", 10)
    cache.put(None, [1, 2], "base", 10)

    assert cache.drop_adapter("p@v1") == 2
    assert cache.lookup("p@v1", [1, 2]) is None
    assert len(cache) == 2 and cache.nbytes == 20
    assert cache.drop_adapter("p@v1") == 0
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
