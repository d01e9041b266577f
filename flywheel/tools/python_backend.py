"""Python toolsets: a class at `package.module:Class` (or an entry point of the group
`flywheel.toolsets`), one instance per episode.

The class's public methods are its tools, except `reset` and `state`:

* arguments and description come from the signature and the docstring (its first
  paragraph), the schema from the annotations (pydantic, as MCP's Python servers do);
  arguments are validated by the same model before the call, and what it rejects goes back
  to the model as the error message;
* or the class declares its tools: `flywheel_tools = [<OpenAI function tool>, …]` (flat:
  `{"type": "function", "name", "description", "parameters"}`, `"x-unsafe": true` marks a
  destructive one); its methods then validate their own arguments;
* `reset(self, initial_state)` is called at the start of every episode (with None when the
  episode names no initial state); `state(self)` returns a JSON-able snapshot for end-state
  checks. Either may be async.
* a method marked with `flywheel.tools.destructive` is destructive.

A method that raises answers the model with `error: <message>` (as a tool runtime would),
and one that runs past the per-call timeout with a timeout message. Sync methods run in a
worker thread so that the timeout holds; a sync method that never returns keeps its thread.
An exception from the class itself (`__init__`, `reset`, `state`) is the toolset failing:
the attempt is not run.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError, create_model

from flywheel.tools.backend import (
    CallResult,
    Described,
    ToolsetError,
    timeout_result,
    unavailable,
)
from flywheel.tools.descriptors import ToolDescriptor
from flywheel.toolsets import PythonClass

F = TypeVar("F", bound=Callable[..., Any])
_RESERVED = {"reset", "state"}
_MARK = "__flywheel_destructive__"


def destructive(method: F) -> F:
    """Mark a Python toolset's method as destructive (never run live without allowance)."""
    setattr(method, _MARK, True)
    return method


ENTRY_POINTS = "flywheel.toolsets"


def load_class(target: str) -> type:
    """The class at `package.module:Class`, or the one entry point `target` of the group
    `flywheel.toolsets` names."""
    if ":" not in target:
        found = [ep for ep in entry_points(group=ENTRY_POINTS) if ep.name == target]
        if not found:
            names = sorted(ep.name for ep in entry_points(group=ENTRY_POINTS))
            raise ToolsetError(f"Python toolset {target!r}: no entry point of that name in "
                               f"the group {ENTRY_POINTS!r} (installed: {names})")
        target = found[0].value
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolsetError(f"Python toolset {target}: cannot import {module_name} ({exc})") \
            from exc
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ToolsetError(f"Python toolset {target}: {module_name} has no class {attr!r}")
    return cls


def _describe(method: Callable[..., Any]) -> str:
    doc = inspect.getdoc(method) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def _arguments_model(name: str, method: Callable[..., Any], *, bound: bool) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    params = list(inspect.signature(method).parameters.values())
    for param in params[1:] if bound else params:  # an instance method's `self`
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        annotation = Any if param.annotation is inspect.Parameter.empty else param.annotation
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (annotation, default)
    model: type[BaseModel] = create_model(f"{name}_arguments", **fields)
    return model


def tools_of(cls: type) -> tuple[list[ToolDescriptor], dict[str, type[BaseModel] | None]]:
    """The class's tools, and per tool the model that validates its arguments (None: the
    class declared the schema and validates itself)."""
    declared = getattr(cls, "flywheel_tools", None)
    tools: list[ToolDescriptor] = []
    if declared is not None:
        tools = [ToolDescriptor(name=t["name"], description=t.get("description", ""),
                                parameters=dict(t.get("parameters") or {"type": "object",
                                                                         "properties": {}}),
                                marked_destructive=bool(t.get("x-unsafe")))
                 for t in declared]
        missing = [t.name for t in tools if not callable(getattr(cls, t.name, None))]
        if missing:
            raise ToolsetError(f"Python toolset {cls.__name__} declares {missing} in "
                               f"flywheel_tools but has no such methods")
        return tools, dict.fromkeys((t.name for t in tools), None)
    models: dict[str, type[BaseModel] | None] = {}
    for name, method in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name in _RESERVED:
            continue
        model = _arguments_model(name, method, bound=not isinstance(
            inspect.getattr_static(cls, name), staticmethod))
        schema = model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        tools.append(ToolDescriptor(name=name, description=_describe(method),
                                    parameters=schema,
                                    marked_destructive=bool(getattr(method, _MARK, False))))
        models[name] = model
    return tools, models


async def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


class PythonBackend:
    def __init__(self, name: str, config: PythonClass) -> None:
        self.name, self.config = name, config
        self._cls: type | None = None
        self._models: dict[str, type[BaseModel] | None] = {}

    def _load(self) -> type:
        if self._cls is None:
            cls = load_class(self.config.target)
            self._models = tools_of(cls)[1]
            self._cls = cls
        return self._cls

    async def describe(self, timeout: float) -> Described:
        cls = self._load()
        tools = tools_of(cls)[0]
        protocol = [n for n, present in (("flywheel_reset", hasattr(cls, "reset")),
                                         ("flywheel_state", hasattr(cls, "state"))) if present]
        return Described([*tools, *(ToolDescriptor(name=p) for p in protocol)])

    async def open(self, key: str, initial_state: dict[str, Any] | None,
                   timeout: float) -> PythonSession:
        try:
            instance = self._load()()
        except Exception as exc:
            raise unavailable(self.name, f"could not create the toolset: "
                              f"{type(exc).__name__}: {exc}"[:500]) from exc
        if not hasattr(instance, "reset"):
            if initial_state is not None:
                raise unavailable(self.name, "the episode starts from an initial state but "
                                  "the class has no reset(initial_state) method")
            return PythonSession(self, instance)
        try:
            await asyncio.wait_for(_run(instance.reset, initial_state), timeout)
        except Exception as exc:
            raise unavailable(self.name, f"reset failed: {type(exc).__name__}: {exc}"[:500]) \
                from exc
        return PythonSession(self, instance)

    async def aclose(self) -> None:
        return None


class PythonSession:
    def __init__(self, backend: PythonBackend, instance: Any) -> None:
        self.backend, self.instance = backend, instance

    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> CallResult:
        model = self.backend._models.get(name)
        if model is not None:
            unknown = sorted(set(arguments) - set(model.model_fields))
            if unknown:
                return CallResult(f"error: {name} takes no argument(s) {unknown}; its "
                                  f"arguments are {sorted(model.model_fields)}", "error")
            try:
                arguments = dict(model.model_validate(arguments))
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: "
                                     f"{e['msg']}" for e in exc.errors())
                return CallResult(f"error: invalid arguments for {name}: {problems}", "error")
        try:
            value = await asyncio.wait_for(_run(getattr(self.instance, name), **arguments),
                                           timeout)
        except TimeoutError:
            return timeout_result(name, timeout)
        except Exception as exc:  # the tool raised (a declared tool's bad arguments too)
            return CallResult(f"error: {exc}", "error")
        return CallResult(_as_text(value))

    async def state(self) -> dict[str, Any] | None:
        if not hasattr(self.instance, "state"):
            return None
        try:
            snapshot = await _run(self.instance.state)
            return dict(json.loads(json.dumps(snapshot)))
        except Exception as exc:
            raise unavailable(self.backend.name, f"state() failed: {exc}") from exc

    async def close(self) -> None:
        self.instance = None
