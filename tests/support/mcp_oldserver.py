"""An MCP server of a protocol revision older than any the `mcp` SDK speaks (2023-06-01).

It speaks JSON-RPC over stdio as any MCP server does, answers `initialize` with its own
protocol version and knows no other method (no `server/discover`): what a client meets
when a server was never upgraded. `flywheel tools add|check` must refuse it by name.
"""

from __future__ import annotations

import json
import sys

VERSION = "2023-06-01"

for line in sys.stdin:
    try:
        message = json.loads(line)
    except json.JSONDecodeError:
        continue
    if "id" not in message:
        continue  # a notification
    if message.get("method") == "initialize":
        reply = {"jsonrpc": "2.0", "id": message["id"], "result": {
            "protocolVersion": VERSION, "capabilities": {"tools": {}},
            "serverInfo": {"name": "old-notes", "version": "0.1"}}}
    else:
        reply = {"jsonrpc": "2.0", "id": message["id"], "error": {
            "code": -32601, "message": f"method not found: {message.get('method')}"}}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
