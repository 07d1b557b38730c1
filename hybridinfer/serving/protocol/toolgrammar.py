"""Forced tool calls as a grammar: `tool_choice` "required" / a named function (Anthropic's "any" / "tool") held by
llguidance to a well-formed call of a declared tool whose arguments follow its JSON schema.

The prompt already ends with the start of the call (`prompt.forced_prefix`: `<tool_call>\\n`, and for a named tool
its name too), so the model continues a call it has begun; the grammar (a Lark grammar in llguidance's dialect)
holds the rest, in the form the chat template teaches:
- JSON (Hermes / Qwen2.5 / Qwen3): `{"name": NAME, "arguments": {...}}` then `\\n</tool_call>`, the arguments an
  llguidance `%json` of the tool's parameters schema;
- XML (Qwen3.5 / Qwen3-Coder): `<function=NAME>\\n` then one `<parameter=P>\\nVALUE\\n</parameter>\\n` per declared
  property (in the schema's order; the required ones must come, the others may), then `</function>\\n</tool_call>`.
  A string property's value is raw text up to the first `\\n</parameter>` (its enum, if it has one, as literals);
  any other value is JSON following the property's schema, as the output parser reads it back.
Once the call is closed the grammar is done and only an end-of-generation token may follow."""

from __future__ import annotations

import json

_PARAM_END = "\n</parameter>\n"


def _lit(s: str) -> str:
    """A Lark string literal of `s` (JSON's escapes are Lark's)."""
    return json.dumps(s, ensure_ascii=False)


# JSON laid out as the templates show calls (`{"a": 1, "b": 2}`), with no room for free whitespace: a sampled
# model can otherwise spend its whole max_tokens on blank lines inside a call
_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _json(schema) -> str:
    schema = schema if isinstance(schema, dict) else {}
    return "%json " + json.dumps({**schema, "x-guidance": _LAYOUT}, ensure_ascii=False)


def _call_schema(tool: dict) -> dict:
    f = tool["function"]
    return {"type": "object", "properties": {"name": {"const": f["name"]},
                                             "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _xml_params(rule: str, params: dict | None, rules: list[str]) -> str:
    """The rule body of one tool's `<parameter=...>` blocks (sub-rules appended to `rules`)."""
    params = params if isinstance(params, dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or ())
    parts = []
    for j, (name, schema) in enumerate(props.items()):
        r = f"{rule}_p{j}"
        schema = schema if isinstance(schema, dict) else {}
        head = _lit(f"<parameter={name}>\n")
        if schema.get("type") == "string":
            enum = [e for e in schema.get("enum") or () if isinstance(e, str)]
            if enum:
                rules.append(f"{r}: {head} ({' | '.join(_lit(e) for e in enum)}) {_lit(_PARAM_END)}")
            else:  # lazy: the text ends at the first closing tag, so a value cannot swallow it
                rules.append(f"{r}: {head} {r}_v")
                rules.append(f"{r}_v[lazy]: /(?s:.*)\\n<\\/parameter>\\n/")
        else:
            rules.append(f"{r}: {head} {_json(schema)} {_lit(_PARAM_END)}")
        parts.append(r if name in required else f"{r}?")
    return " ".join(parts)


def call_grammar(tools: list[dict], name: str | None, xml: bool) -> str:
    """The Lark grammar of what follows `forced_prefix` for a call of the tool `name` (None: any of `tools`)."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    close = _lit("\n</tool_call>")
    if not xml:
        if name is not None:  # the prefix holds `{"name": NAME, "arguments": `
            params = chosen[0]["function"].get("parameters") or {"type": "object"}
            return f"start: {_json(params)} {_lit('}')} {close}"
        return f"start: {_json({'anyOf': [_call_schema(t) for t in chosen]})} {close}"
    rules: list[str] = []
    end = _lit("</function>\n</tool_call>")
    if name is not None:  # the prefix holds `<function=NAME>\n`
        body = _xml_params("t0", chosen[0]["function"].get("parameters"), rules)
        return "\n".join([f"start: {body} {end}", *rules])
    alts = []
    for i, t in enumerate(chosen):
        body = _xml_params(f"t{i}", t["function"].get("parameters"), rules)
        head = _lit("<function=" + t["function"]["name"] + ">\n")
        rules.append(f"t{i}: {head} {body} {end}")
        alts.append(f"t{i}")
    return "\n".join([f"start: {' | '.join(alts)}", *rules])
