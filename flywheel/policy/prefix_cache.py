"""The local engine's prefix cache: encoded prompts kept across calls, least recently used first
out, under a byte cap.

Every task of an agent starts with the same system prompt and tool block, every turn of an
episode starts with the turns before it, and the gate and serving send the same prompts
again. An entry is one encoded prompt, keyed by (adapter served name or None, token ids):
keys/values depend on the weights, so an adapter's entries serve only that adapter and go
when it is retired. A lookup returns the entry sharing the longest start with the new prompt:
causal attention makes a cached prompt's keys/values cut at any position exactly those of
that start, so nothing needs to know where the system prompt ends.

Pure Python: values are opaque, sized by the caller. Not thread-safe: the engine touches it
only from its one worker thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")
Key = tuple[str | None, tuple[int, ...]]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(frozen=True)
class Hit(Generic[V]):
    value: V
    shared: int
    """Leading tokens the entry and the looked-up prompt have in common."""
    exact: bool
    """The entry is that very prompt."""


class PrefixCache(Generic[V]):
    """LRU of encoded prompts under `capacity_bytes` (0 = disabled: nothing is kept)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"prefix cache capacity must be ≥ 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self._entries: OrderedDict[Key, tuple[V, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0
        """Lookups that found ≥ `minimum` shared tokens, and those that did not."""

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, adapter: str | None, ids: Sequence[int], minimum: int = 1) -> Hit[V] | None:
        """The entry of `adapter` sharing the longest start with `ids` (≥ `minimum` tokens),
        now the most recently used; None when there is none."""
        best: tuple[int, Key] | None = None
        for key in self._entries:
            if key[0] == adapter:
                shared = common_prefix_len(key[1], ids)
                if shared >= minimum and (best is None or shared > best[0]):
                    best = (shared, key)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        shared, key = best
        self._entries.move_to_end(key)
        return Hit(self._entries[key][0], shared, exact=shared == len(key[1]) == len(ids))

    def put(self, adapter: str | None, ids: Sequence[int], value: V, nbytes: int) -> bool:
        """Keep `value` for (adapter, ids), evicting the least recently used entries to fit;
        False (nothing kept) when it alone exceeds the capacity."""
        key = (adapter, tuple(ids))
        self._remove(key)
        if nbytes > self.capacity:
            return False
        while self.nbytes + nbytes > self.capacity:
            self._remove(next(iter(self._entries)))
        self._entries[key] = (value, nbytes)
        self.nbytes += nbytes
        return True

    def drop_adapter(self, adapter: str) -> int:
        """Forget every entry computed under `adapter`; how many there were."""
        keys = [k for k in self._entries if k[0] == adapter]
        for key in keys:
            self._remove(key)
        return len(keys)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _remove(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1]
