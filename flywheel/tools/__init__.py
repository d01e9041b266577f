"""The agent's own tools in the loop: toolsets, per-episode sessions, replay, safety.

* `descriptors` — what a toolset offers (tools read from the backend), registrations;
* `backend` — the contract every kind implements, and who is to blame for a failure;
* `mcp_connection`, `mcp_backend` — MCP servers over stdio and streamable HTTP (the
  official `mcp` SDK); `python_backend` — a Python class; `mcp_serve` — a Python toolset
  served over MCP;
* `safety` — destructive tools and what may run live; `replay` — the logged path;
* `session` — one episode: safety, replay, then the backend; `runtime` — sessions under a
  bound per toolset, the catalog by name; `registry` — read, register, remove (Postgres).

The `toolset` environment (`flywheel.environments.toolset`) runs episodes on it through
the rollout loop; docs/TOOLS.md says what runs live and where.
"""

from flywheel.tools.python_backend import destructive

__all__ = ["destructive"]
