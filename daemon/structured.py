"""Structured output in the OpenAI API: which request field constrains the output, and tool calls.

One request may carry at most one constraint, from any of the shapes clients send: OpenAI's
`response_format` (`json_object`, or `json_schema` with its `schema`), vLLM's `structured_outputs`
(`json` | `json_object` | `regex` | `choice` | `grammar`) and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, or a forced tool call (`tools` with `tool_choice` `"required"` or a
named function: the call is generated under the function's `parameters` schema). `select` maps the
request onto the engine's `StructuredOutputs` and remembers the API field it came from, so a schema
the engine cannot compile is refused with a 400 naming that field. Nothing here compiles anything:
the daemon stays free of the grammar engine (and of torch), and the engine's compile cache serves
every request with the same schema. `tool_choice: "auto"` (the default when tools are given) needs a
model-specific parser of free text and is refused.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from mleagle.daemon.errors import APIError, from_validation
from mleagle.engine.contract.sampling_params import StructuredOutputs


@dataclass
class ToolPlan:
    """A forced tool call: the one function (named) or any of them (required, a JSON array of calls)."""

    names: list[str]
    required: bool  # True: `[{"name", "parameters"}, ...]`; False: the named function's arguments


@dataclass
class Constraint:
    so: StructuredOutputs | None = None
    field: str | None = None  # the API field it came from (the `param` of a refusal)
    tools: ToolPlan | None = None
    tool_defs: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _so(field_: str, **kw: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs.model_validate(kw)
    except ValidationError as e:
        err = from_validation(e)
        err.status, err.param = 400, field_
        raise err from None


def _tool_schema(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool | None = None,
                 ) -> tuple[dict[str, Any], ToolPlan, str]:
    funcs: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise APIError(400, "only tools of type 'function' are supported", param=f"tools.{i}", code="unsupported")
        f = t["function"]
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, "a function needs a name", param=f"tools.{i}.function.name")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, "function parameters must be a JSON schema object", param=f"tools.{i}.function.parameters")
        funcs.append({"name": f["name"], "parameters": params, "index": i})
    if tool_choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
                  "required": ["name", "parameters"]} for f in funcs]
        schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if parallel is False:  # `parallel_tool_calls: false`: exactly one call
            schema["maxItems"] = 1
        return schema, ToolPlan([f["name"] for f in funcs], True), "tools"
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
                       " ('auto' needs a model-specific tool-call parser and is not supported)",
                       param="tool_choice", code="unsupported")
    match = [f for f in funcs if f["name"] == name]
    if not match:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    f = match[0]
    return f["parameters"], ToolPlan([name], False), f"tools.{f['index']}.function.parameters"


def select(req: Any) -> Constraint:
    """The one constraint `req` (a completion or chat request) asks for, or none."""
    found: list[tuple[str, StructuredOutputs]] = []
    out = Constraint()
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", _so("response_format", json_object=True)))
        elif rf.type == "json_schema":
            js = rf.json_schema
            if js is None or js.schema_ is None:
                raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                               param="response_format.json_schema")
            found.append(("response_format.json_schema.schema", _so("response_format.json_schema.schema", json=js.schema_)))
        else:
            raise APIError(400, f"response_format type {rf.type!r} is not supported (text, json_object, json_schema)",
                           param="response_format.type", code="unsupported")
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
        parsed = _so("structured_outputs", **so)
        found.append((f"structured_outputs.{parsed.kind}", parsed))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        v = getattr(req, name, None)
        if v is not None:
            found.append((name, _so(name, **{kind: v})))
    tools = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if tools and choice != "none":
        schema, plan, fld = _tool_schema(tools, choice if choice is not None else "auto",
                                         getattr(req, "parallel_tool_calls", None))
        found.append((fld, _so(fld, json=schema)))
        out.tools = plan
        out.tool_defs = [t["function"] for t in tools]
    if len(found) > 1:
        raise APIError(400, f"one output constraint per request: {found[0][0]} and {found[1][0]} both constrain it",
                       param=found[1][0])
    if found:
        out.field, out.so = found[0]
    return out


def tool_prompt(tool_defs: list[dict[str, Any]]) -> str:
    """The tools described in a system message, for chat templates that do not render `tools`."""
    return ("You can call the following functions. Reply with the call's arguments as JSON.\n"
            + json.dumps([{k: f[k] for k in ("name", "description", "parameters") if k in f} for f in tool_defs],
                         ensure_ascii=False))


def tool_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` from the constrained output (arguments as JSON text, as OpenAI sends them).
    A truncated output (finish `length`) that does not parse is returned as the named call's raw text."""
    def call(name: str, args: str) -> dict[str, Any]:
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}

    if not plan.required:
        return [call(plan.names[0], text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return [call(plan.names[0] if len(plan.names) == 1 else "", text)]
    return [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
