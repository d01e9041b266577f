"""Records an outside tester found that broke the data path, with what must become of them.

Shared by the decoding unit tests, the gateway/Kafka agreement test and the property test
(as fixed examples). `expected` is the reason of the dead letter (None: stored), `says` a
phrase the error must contain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Poison:
    name: str
    value: bytes
    expected: str | None
    says: str = ""


FIXED_ID = "5f0c4a55-5d3b-4c1e-9a57-0d6f3c9e2b10"


def pair(*, answer: str = "Your order ships today.", tool_calls: object = None,
         prompt_tokens: int = 12) -> dict[str, object]:
    """A request/response pair (Data Flywheel shape) with no agent and no outcome."""
    message: dict[str, object] = {"role": "assistant", "content": answer}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {"timestamp": 1767225600, "client_id": "shop", "workload_id": "orders",
            "request": {"model": "m", "messages": [{"role": "user", "content": "where is it?"}]},
            "response": {"id": "chatcmpl-poison", "choices": [{"message": message}],
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 5}}}

POISON: list[Poison] = [
    # 1. a timestamp valid in its own offset, out of range once converted to UTC
    Poison("year 1 at +23:59", b'{"agent":"x","started_at":"0001-01-01T00:00:00+23:59",'
           b'"outcome":{"status":"success"}}', "schema", "once converted to UTC"),
    Poison("year 9999 at -23:59", b'{"agent":"x","started_at":"9999-12-31T23:59:59-23:59",'
           b'"outcome":{"status":"success"}}', "schema", "once converted to UTC"),
    # 2. wrong types that made normalize()/chat_to_items() raise TypeError
    Poison("metadata.unknown_fields not an object", json.dumps(
        {"trajectory_id": FIXED_ID, "agent": "a", "outcome": {"status": "success"},
         "metadata": {"unknown_fields": 5}, "zzz": 1}).encode(), "schema",
        "metadata.unknown_fields must be an object"),
    Poison("tool_calls not a list", b'{"agent":"a","messages":[{"role":"assistant",'
           b'"tool_calls":5}],"outcome":{"status":"success"}}', "schema",
           "tool_calls must be a list"),
    # 3. a lone surrogate (dead-lettered as "nested too deeply", then wedged the miner)
    Poison("lone surrogate in content", b'{"agent":"a","session_id":"s","messages":[{"role":'
           b'"user","content":"x\\ud800y"}],"outcome":{"status":"failure"}}', "schema",
           "lone surrogate"),
    Poison("lone surrogate in a key", b'{"agent":"a","metadata":{"k\\udc00":1},'
           b'"outcome":{"status":"success"}}', "schema", "a key contains a lone surrogate"),
    # 4. NaN/Infinity: refused on both paths (the gateway used to store null)
    Poison("NaN reward", b'{"agent":"a","outcome":{"status":"failure","reward":NaN}}',
           "schema", "NaN, Infinity"),
    Poison("Infinity in metadata", b'{"agent":"a","metadata":{"x":[1,-Infinity]},'
           b'"outcome":{"status":"success"}}', "schema", "NaN, Infinity"),
    Poison("1e400 overflows a double", b'{"agent":"a","metadata":{"x":1e400},'
           b'"outcome":{"status":"success"}}', "schema", "NaN, Infinity"),
    # 4. a backslash followed by u0000 is text, not a NUL: stored
    Poison("backslash-u0000 text", b'{"agent":"a","messages":[{"role":"user","content":'
           b'"C:\\\\u0000file"}],"outcome":{"status":"success"}}', None),
    Poison("a real NUL", b'{"agent":"a","messages":[{"role":"user","content":"a\\u0000b"}],'
           b'"outcome":{"status":"success"}}', "schema", "NUL character"),
    Poison("a count beyond bigint", b'{"agent":"a","usage":{"input_tokens":9223372036854775808},'
           b'"outcome":{"status":"success"}}', "schema", "less than or equal to"),
    Poison("a paired surrogate (an emoji) is fine", b'{"agent":"\\ud83d\\ude00",'
           b'"outcome":{"status":"success"}}', None),
    # 5. the shapes agents log (flywheel.formats) are decided by the same boundary
    Poison("pair: a NUL in the answer", json.dumps(pair(answer="a\u0000b")).encode(), "schema",
           "response.choices[0].message.content: contains a NUL character"),
    Poison("pair: response not an object", json.dumps({**pair(), "response": 5}).encode(),
           "schema", "'response' must be an object"),
    Poison("pair: tool_calls not a list", json.dumps(pair(tool_calls=5)).encode(), "schema",
           "tool_calls must be a list"),
    Poison("pair: usage beyond bigint", json.dumps(pair(prompt_tokens=2**63)).encode(),
           "schema", "less than or equal to"),
    Poison("pair: a timestamp past year 9999", json.dumps({**pair(), "timestamp": 10**20})
           .encode(), "schema", "dates after 9999"),
    Poison("neither items nor an outcome", b'{"agent":"a","metadata":{}}', "schema",
           "it has neither"),
    Poison("a pair without agent or outcome is stored", json.dumps(pair()).encode(), None),
]
