"""Toolsets: the agent's own tools as a user registers them (config, `flywheel tools`, the API).

A toolset is named, and every registration of it is a new version in the event log
(`ToolsetRegistered`), with the tools' schemas read from the backend at that moment. The
backend is one of (discriminated on `kind`):

* `mcp_stdio` — an MCP server started as a command, speaking MCP over its stdin/stdout.
  `sessions="process"` (the default) starts a fresh server process for every episode, so no
  two episodes can share state; `"shared"` keeps one server process and keeps episodes apart
  by the reset protocol (below): far cheaper, but the server must implement it.
* `mcp_http` — an MCP server at a streamable-HTTP `url`, with `headers`; a header value may
  name an environment variable as `${NAME}` (read when connecting, never stored), which is
  how a secret stays out of the event log. Episodes are kept apart by the reset protocol.
* `python` — a class at an import path (`package.module:Class`) or an entry point of the
  group `flywheel.toolsets`: one instance per episode, its public methods are the tools
  (`flywheel.tools.python_backend`).

The reset protocol (docs/TOOLS.md): every call Flywheel makes carries the episode's session
key in the request's `_meta` (`io.flywheel/session`); a server that lists a tool
`flywheel_reset` gets `{"initial_state": …}` at the start of every episode, and one that lists
`flywheel_state` is asked for the episode's state as JSON (the end-state snapshot), and
one that lists `flywheel_close` is told when the episode is over (drop its state). Those
tools are never offered to the model.

Every toolset also says what may run live (`allow_destructive`, `deny`,
`unannotated_destructive`), what a replayed episode does when the policy leaves the logged
path (`on_divergence`), whether it is a `dry_run`, and its limits (`max_sessions`,
`call_timeout_s`, `open_timeout_s`).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from flywheel.tasks import ReplayRule

NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
RESET_TOOL = "flywheel_reset"
STATE_TOOL = "flywheel_state"
CLOSE_TOOL = "flywheel_close"
SESSION_META_KEY = "io.flywheel/session"
PROTOCOL_TOOLS = frozenset({RESET_TOOL, STATE_TOOL, CLOSE_TOOL})
"""Tools of the reset protocol: Flywheel calls them, the model never sees them."""
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Common(_Frozen):
    on_divergence: ReplayRule = "end"
    """What a replayed episode does when the policy leaves the logged path: `live` (the live
    backend, brought to the logged state by running the logged calls first), `end` (the
    episode ends there; the verifier scores what was done) or `mask` (the attempt is not
    run: excluded from training and counted)."""
    allow_destructive: list[str] = Field(default_factory=list)
    """Destructive tools this toolset may execute live (`["*"]`: all of them). Point such a
    toolset at a staging copy, never at production systems."""
    deny: list[str] = Field(default_factory=list)
    """Tools treated as destructive whatever their annotations say."""
    unannotated_destructive: bool = True
    """Treat MCP tools with no `destructiveHint`/`readOnlyHint` as destructive: MCP's own
    default reading of an unannotated tool, so a server that says nothing about a tool's side
    effects never has it run live by default. Off: only tools marked destructive are (for a
    server you know under-annotates harmless tools; `flywheel tools show` lists which tools
    are refused)."""
    dry_run: bool = False
    """Never contact the backend during an episode: calls are answered from replay or the
    recorded `stubs` (a generic "not executed" answer otherwise)."""
    stubs: dict[str, str] = Field(default_factory=dict)
    """Recorded answers by tool name, for dry runs."""
    max_sessions: int = Field(default=64, ge=1)
    """Episodes open on this toolset at once in one process (further ones wait)."""
    call_timeout_s: float = Field(default=30.0, gt=0)
    """Longest one tool call may take; past it the model gets a timeout message and the
    episode goes on."""
    open_timeout_s: float = Field(default=30.0, gt=0)
    """Longest starting a session (a server process, a reset) may take; past it the
    attempt is not run."""


class McpStdio(_Common):
    kind: Literal["mcp_stdio"] = "mcp_stdio"
    command: str
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment of the server process (values may be `${NAME}` references)."""
    cwd: str | None = None
    sessions: Literal["process", "shared"] = "process"
    max_starting: int | None = Field(default=None, ge=1)
    """With `sessions="process"`: server processes one process starts at once (None: its
    cores). Further episodes wait their turn before their server is spawned, and that wait
    does not count against `open_timeout_s`. Starting a Python server is CPU work (~0.5 s
    of a core for the bundled one): spawned all at once, 48 took 23 s to answer on an idle
    2-core machine (one: 0.7 s), and on a loaded one most of a gate round's sessions
    missed the handshake."""


class McpHttp(_Common):
    kind: Literal["mcp_http"] = "mcp_http"
    url: str = Field(pattern=r"^https?://")
    headers: dict[str, str] = Field(default_factory=dict)


class PythonClass(_Common):
    kind: Literal["python"] = "python"
    target: str = Field(pattern=r"^([A-Za-z_][\w.]*:[A-Za-z_]\w*|[A-Za-z0-9][\w.-]*)$")
    """`package.module:Class`, or the name of an entry point in the group
    `flywheel.toolsets` (a package that ships a toolset declares one)."""


ToolsetConfig = Annotated[McpStdio | McpHttp | PythonClass, Field(discriminator="kind")]


def expand_env(value: str, environ: dict[str, str]) -> str:
    """`value` with every `${NAME}` replaced from `environ`; a missing one is an error."""
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise KeyError(f"environment variable {name} is not set (referenced as "
                           f"${{{name}}} by the toolset's configuration)")
        return environ[name]

    return _ENV_REF.sub(one, value)


def masked(value: str) -> str:
    """A header or env value as the event log and `show` keep it: one that takes its secret
    from the environment (`Bearer ${TOKEN}`) as written, a literal one hidden."""
    return value if _ENV_REF.search(value) else "***"
