"""From API messages to the token ids of one request: template messages, tools, tool_choice, thinking.

Both APIs end in `build_chat`: messages as the chat template takes them ({role, content: str, tool_calls with
arguments as a mapping, reasoning_content}), tools as OpenAI function definitions. Templates that render tools
themselves (Qwen) get them through the template's `tools` variable; for one that ignores tools the tools, calls
and results are written into the messages in the Hermes / Qwen2.5 format, which is the one the parser reads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ...engine.images import chat_sources
from ...engine.text import chat_boundaries
from .errors import ApiError, bad_param
from .toolcalls import MAX_JSON_DEPTH, TooDeep, loads_bounded, value_depth
from .toolgrammar import call_grammar

_PROBE = "hybridinfer_probe_fn"


@dataclass
class TemplateInfo:
    """What the model's chat template does with tools, found once by rendering probes."""

    native_tools: bool  # the template renders `tools`, tool calls and tool results itself
    xml_calls: bool  # it teaches the XML call form (Qwen3.5, Qwen3-Coder) rather than JSON in the tag

    @classmethod
    def probe(cls, engine) -> TemplateInfo:
        tool = {"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {"type": "object"}}}
        try:
            text = engine.chat_prompt([{"role": "user", "content": "hi"}], tools=[tool])
        except Exception:  # noqa: BLE001 - a template that fails with tools is one without them
            return cls(False, False)
        return cls(_PROBE in text, "<function=" in text)


@dataclass
class Prepared:
    """A chat request made into ids, with what the output parser needs to know."""

    ids: list[int]
    turn_boundary: tuple[int, ...] | None  # api.chat_boundaries: the system messages' and the history's ends
    in_reasoning: bool  # the prompt ends inside an open <think> block
    prefix: str = ""  # assistant text the prompt already holds (a forced tool call's start): parsed, not generated
    tools: bool = False
    schemas: dict[str, dict] = field(default_factory=dict)
    grammar: str | None = None  # a forced call's Lark grammar (protocol.toolgrammar): what must follow the prefix
    text: str = ""  # the rendered prompt
    images: list = field(default_factory=list)  # the messages' images, one for each <|image_pad|> slot of ids


def tool_schemas(tools: list[dict]) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


def args_mapping(args, param: str = "arguments"):
    """Templates index tool-call arguments as a mapping; OpenAI sends them as a JSON string (kept as the string
    when it is not a JSON object; a 400 naming `param` when it nests deeper than MAX_JSON_DEPTH, past any tool's
    arguments and towards the interpreter's stack in the template)."""
    if isinstance(args, str):
        try:
            v = loads_bounded(args) if args.strip() else {}
        except TooDeep as e:
            raise bad_param(param, str(e)) from None
        except ValueError:
            return args
        return v if isinstance(v, dict) else args
    if value_depth(args) > MAX_JSON_DEPTH:
        raise bad_param(param, f"nested deeper than {MAX_JSON_DEPTH} levels")
    return args


def _hermes_system(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Tools, calls and results written into plain messages, for a template that knows nothing of them."""
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join('<tool_call>\n' + json.dumps({"name": c["function"]["name"],
                                                           "arguments": c["function"]["arguments"]},
                                                          ensure_ascii=False) + '\n</tool_call>'
                              for c in m.pop("tool_calls"))
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    # consecutive tool results share one user turn, as Qwen's own templates put them
    merged: list[dict] = []
    for m in out:
        if (merged and m["role"] == "user" and merged[-1]["role"] == "user"
                and isinstance(m["content"], str) and isinstance(merged[-1]["content"], str)  # (a list: images)
                and m["content"].startswith("<tool_response>") and merged[-1]["content"].endswith("</tool_response>")):
            merged[-1] = {**merged[-1], "content": merged[-1]["content"] + "\n" + m["content"]}
        else:
            merged.append(m)
    if tools:
        sys_text = _hermes_system(tools)
        if merged and merged[0]["role"] == "system":
            merged[0] = {**merged[0], "content": merged[0]["content"] + "\n\n" + sys_text}
        else:
            merged.insert(0, {"role": "system", "content": sys_text})
    return merged


def forced_prefix(name: str, tools: list[dict], info: TemplateInfo) -> str:
    """The start of the assistant turn that makes a call happen: "required" (any tool) or one named tool. The
    model continues a call it has begun, and toolgrammar.call_grammar holds the rest to a declared tool's schema."""
    if name == "required":
        return "<tool_call>\n"
    if name not in {t["function"]["name"] for t in tools}:
        names = ", ".join(repr(t["function"]["name"]) for t in tools)
        raise bad_param("tool_choice", f"names the tool {name!r}, which is not among the tools given ({names})")
    if info.xml_calls:
        return f"<tool_call>\n<function={name}>\n"
    return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": '


def normalize_tool_choice(choice, tools, param: str = "tool_choice"):
    """OpenAI's tool_choice as None (no tools), "auto", "required" or a tool name."""
    if choice is None:
        return "auto" if tools else None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_param(param, f"must be 'auto', 'none', 'required' or a named function, got {choice!r}")
        if choice != "none" and not tools:
            raise bad_param(param, f"is {choice!r} but no tools were given")
        return None if choice == "none" else choice
    if choice.get("type") == "function" and isinstance((choice.get("function") or {}).get("name"), str):
        if not tools:
            raise bad_param(param, "names a function but no tools were given")
        return {"name": choice["function"]["name"]}
    raise bad_param(param, f"must be 'auto', 'none', 'required' or {{'type': 'function', 'function': {{'name': "
                           f"...}}}}, got {choice!r}")


def check_text_fits(engine, n_chars: int, param: str) -> None:
    """A 400 for text that cannot fit the context whatever it says (no token holds more than the vocabulary's
    longest token's bytes, nor a character less than one byte), before any time goes into rendering and
    tokenizing it."""
    tok = engine.tokenizer
    cap = engine.n_ctx * (tok.max_token_bytes if tok is not None else 1)
    if n_chars > cap:
        raise ApiError(400, f"{param}: {n_chars} characters cannot fit the context of n_ctx={engine.n_ctx} tokens "
                            f"(at most {cap} characters)", param=param, code="context_length_exceeded")


def build_chat(engine, info: TemplateInfo, messages: list[dict], tools: list[dict] | None, choice,
               enable_thinking: bool | None, structured: bool = False) -> Prepared:
    """Render and tokenize a chat. `choice`: None (tools not offered), "auto", "required" or {"name": ...}.
    structured: the answer is held to a grammar from its first token, so an open reasoning block is closed
    (the grammar's JSON would land inside it) and no tool calls are looked for."""
    check_text_fits(engine, sum(len(c) for m in messages if isinstance(c := m.get("content"), str)), "messages")
    use_tools = tools if choice is not None and tools else None
    if info.native_tools:
        msgs, tmpl_tools = messages, use_tools
    else:
        try:
            msgs, tmpl_tools = _hermes_messages(messages, use_tools), None
        except RecursionError:  # tool-call arguments nested deeper than the interpreter's stack
            raise bad_param("messages", "tool-call arguments are nested too deeply") from None
    if engine.tokenizer is None:
        raise ApiError(400, "this model has no vocabulary: send token ids to /v1/completions", param="messages")
    chat = engine.chat_text(msgs, enable_thinking=enable_thinking, tools=tmpl_tools)
    in_reasoning = chat.text.endswith(("<think>\n", "<think>"))
    prefix, grammar = "", None
    if use_tools and choice != "auto":
        name = None if choice == "required" else choice["name"]
        prefix = forced_prefix(name or "required", use_tools, info)
        grammar = call_grammar(use_tools, name, info.xml_calls)
        if in_reasoning:  # a forced call skips the reasoning: close the block as the no-think prompt does
            chat = chat.plus("\n</think>\n\n")
            in_reasoning = False
        chat = chat.plus(text=prefix)  # it names a tool of the request: text, as the tools are
    elif structured and in_reasoning:
        chat = chat.plus("\n</think>\n\n")
        in_reasoning = False
    ids = engine.tokenize_chat(chat)
    hist = lambda ms: engine.tokenize_chat(engine.chat_text(  # noqa: E731
        ms, add_generation_prompt=False, enable_thinking=enable_thinking, tools=tmpl_tools))
    boundary = chat_boundaries(msgs, ids, hist) or None
    return Prepared(ids, boundary, in_reasoning, prefix, bool(use_tools) and not structured,
                    tool_schemas(use_tools) if use_tools else {}, grammar, chat.text, chat_sources(msgs))
