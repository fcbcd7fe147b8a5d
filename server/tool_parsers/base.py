"""What every tool-call parser shares: the call it finds, the match it reports, and JSON checks."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from server.json_schemas import as_llama_cpp_reads, placed_at, with_definitions

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # a name a format writes bare, without JSON quotes
# llguidance's options for JSON a model writes under a request's schema:
# - written one way, as templates show it ({"a": 1, "b": 2}): an unsure model cannot run on in blanks;
# - lenient: a keyword or string format it cannot enforce is ignored and `oneOf` is read as `anyOf`, as
#   llama.cpp reads a schema (pydantic writes `uniqueItems` for a set, `oneOf` for a discriminated union,
#   format "password" for a SecretStr; strict, each would be a 400).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str | None = None  # the id the model wrote for the call, where its format has one


@dataclass(frozen=True)
class Match:
    """A span of output, from a marker on, that a parser has read."""

    end: int  # characters of the span
    calls: tuple[FunctionCall, ...] = ()
    content: str = ""  # the text the span stands for besides its calls


class ToolParser:
    """One model family's tool-call format. Subclasses set `name` and `markers` and write `match`."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # where a tool-call span may start
    needs_special_tokens: ClassVar[bool] = False  # its markers are special tokens the decoder would drop

    def __init__(self, tools: list[dict] | None = None, added_tokens: Mapping[str, int] | None = None,
                 template: str = "") -> None:
        self.tools = tools or []  # OpenAI function definitions (a format without JSON needs their types)
        self.added_tokens = added_tokens or {}  # the tokenizer's added tokens: text -> id
        self.template = template  # the chat template's source, where a format has variants

    def match(self, text: str, final: bool) -> Match | None:
        """`text` starts with a marker. None: not decided yet, more output may complete it.
        With `final` (the output has ended) a Match is always returned; a malformed span is content."""
        raise NotImplementedError

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        """A Lark grammar (llguidance) for output that is exactly one valid call, to `name` or to any
        of `tools`; None where this format has none yet."""
        return None

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def literal(self, text: str) -> str:
        """`text` in a Lark grammar: the added token where the tokenizer has one (a model writes its
        markers as those), else the text."""
        token = self.added_tokens.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)

    def call_rules(self, tools: list[dict], name: str | None, call_rule: Callable[[dict], str]) -> str:
        """Lark rules: `call` is one of `tools` (only `name`, if given), each written by `call_rule`
        from its function definition (each its own rule: `%json` stands alone in a rule)."""
        bodies = [call_rule(f) for f in functions(tools, name)]
        rules = [f"call_{i}: {body}" for i, body in enumerate(bodies)]
        return f"call: {' | '.join(f'call_{i}' for i in range(len(bodies)))}\n" + "\n".join(rules) + "\n"

    def parameter_types(self, name: str) -> dict[str, Any]:
        """The declared `type` of each parameter of the offered function `name` (read by `bare_value`)."""
        for tool in self.tools:
            function = tool.get("function", {})
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties") or {}
                return {key: spec.get("type") for key, spec in properties.items() if isinstance(spec, dict)}
        return {}

    def prompt_tools(self, tools: list[dict]) -> str | None:
        """The tool list as text for the system prompt, for a template that takes tool calls but does
        not render a tool list itself; None where this format's templates render it."""
        return None


class BlockParser(ToolParser):
    """A format whose calls sit in a block, from its marker to the first `closing` after it: a block is whole calls
    or text, and one the output ends inside is text. Subclasses set `closing` and write `read_block`."""

    closing: ClassVar[str]

    def match(self, text: str, final: bool) -> Match | None:
        close = text.find(self.closing)
        if close < 0:
            return malformed(text) if final else None
        end = close + len(self.closing)
        calls = self.read_block(text[len(self.markers[0]): close])
        return Match(end, calls) if calls else malformed(text, end)

    def read_block(self, body: str) -> tuple[FunctionCall, ...] | None:
        """The calls of one block's `body` (between its tags); None where it is not calls."""
        raise NotImplementedError


def call_schema(tools: list[dict], name: str | None, arguments_key: str = "arguments") -> dict:
    """JSON schema of `{"name": ..., "arguments": {...}}` for one of `tools` (only `name`, if given);
    `arguments_key`: the format's name for the arguments."""
    chosen = functions(tools, name)
    # where each function's arguments sit in the whole schema: their `$ref`s must point there
    places = [f"/properties/{arguments_key}"] if len(chosen) == 1 else \
        [f"/anyOf/{i}/properties/{arguments_key}" for i in range(len(chosen))]
    options = [
        {"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
         "properties": {"name": {"const": f["name"]}, arguments_key: placed_at(parameters_schema(f), place)}}
        for f, place in zip(chosen, places)
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def functions(tools: list[dict], name: str | None) -> list[dict]:
    """The function definitions of `tools` (only the one called `name`, if given)."""
    return [f for f in (tool["function"] for tool in tools) if name is None or f["name"] == name]


def declared_parameters(function: dict) -> dict:
    """The function's `parameters` as the request declares them (what a prompt shows the model)."""
    return function.get("parameters") or {"type": "object"}


def parameters_schema(function: dict) -> dict:
    """The schema a call's arguments are decoded under: the declared one as llama.cpp reads it."""
    return as_llama_cpp_reads(declared_parameters(function))


def parameter_schemas(schema: dict) -> dict[str, dict]:
    """Each parameter's schema in `schema` (a `parameters_schema`), to be used on its own (with the
    definitions it refers to)."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    return {key: with_definitions(spec, schema) if isinstance(spec, dict) else {} for key, spec in properties.items()}


def parameter_rules(function: dict, pair_rule: Callable[[str, dict], str]) -> list[str]:
    """Lark pieces for a function's declared parameters in the schema's order, each written by
    `pair_rule(key, spec)`; an optional one may be left out."""
    schema = parameters_schema(function)
    required = set(schema.get("required") or ())
    return [f"({pair_rule(key, spec)})" + ("" if key in required else "?")
            for key, spec in parameter_schemas(schema).items()]


def ordered_pairs(pairs: list[str], required: list[bool]) -> str | None:
    """A Lark body for `pairs` (rule pieces, one per declared key) in their order, comma-separated, each optional one
    left out at will; None where there are none. The first pair written is any up to the first required one."""
    firsts = []
    for j, pair in enumerate(pairs):
        rest = [f'"," {p}' if required[k] else f'("," {p})?' for k, p in enumerate(pairs) if k > j]
        firsts.append(" ".join([pair, *rest]))
        if required[j]:
            break
    return " | ".join(f"({f})" for f in firsts) or None


def arguments_rule(function: dict) -> str:
    """A Lark rule body for a call's arguments as JSON: valid under the function's `parameters`."""
    return json_rule(parameters_schema(function))


def json_rule(schema: dict) -> str:
    """A Lark rule body for JSON that `schema` accepts, written as templates show JSON."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def bare_value(text: str, declared: Any) -> Any:
    """A value a format writes as bare text: a parameter declared as a string stays text, any other is
    read as JSON where it parses (numbers, booleans, objects) and kept as text where it does not."""
    if declared == "string":
        return text
    parsed = loads(text.strip())
    return text if parsed is None and text.strip() != "null" else parsed


def bare_value_rule(spec: dict) -> str:
    """A Lark rule body for a bare value as templates write it: a declared string as text (its `enum`,
    `const`, length bounds and `pattern` kept, not its `format`), anything else as JSON."""
    if spec.get("type") != "string":
        return json_rule(spec)
    choices = [spec["const"]] if "const" in spec else spec.get("enum")
    if choices:
        return "(" + " | ".join(json.dumps(str(c), ensure_ascii=False) for c in choices) + ")"
    if "pattern" in spec:
        return "/" + spec["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"
    low, high = spec.get("minLength", 0), spec.get("maxLength", "")
    return f"/[^<]{{{low},{high}}}/"  # no markup: the value ends at its closing tag


def malformed(text: str, end: int | None = None) -> Match:
    """The span stays what it was: text."""
    end = len(text) if end is None else end
    return Match(end, content=text[:end])


def function_call(name: Any, arguments: Any) -> FunctionCall | None:
    """A call with a name and a JSON-object argument (a mapping, or text that parses as one); else None."""
    if not isinstance(name, str) or not name.strip():
        return None
    if isinstance(arguments, str):
        arguments = loads(arguments.strip() or "{}")
    if not isinstance(arguments, dict):
        return None
    return FunctionCall(name.strip(), json.dumps(arguments, ensure_ascii=False))


def json_calls(text: str, start: int, final: bool) -> Match | None:
    """The calls written as JSON from `text[start:]` on: a list of `{"name": ..., "arguments": {...}}` objects, or
    one such object. None while the JSON is not complete; the span is text where it does not parse or any item is
    not a call."""
    decoded = decode_prefix(text[start:])
    if decoded is None:
        return malformed(text) if final else None
    value, end = decoded
    end += start
    items = value if isinstance(value, list) else [value]
    calls = [function_call(i.get("name"), i.get("arguments", {})) if isinstance(i, dict) else None for i in items]
    if not calls or None in calls:
        return malformed(text, end)
    return Match(end, tuple(calls))


def loads(text: str) -> Any:
    """JSON, or None where it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def decode_prefix(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after blanks) and where it ends; None if there is none yet."""
    start = len(text) - len(text.lstrip())
    try:
        value, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    return value, end
