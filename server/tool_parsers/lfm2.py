"""LFM2 (dense and MoE, e.g. LFM2-8B-A1B): `<|tool_call_start|>[NAME(key="value", n=2), NAME2()]<|tool_call_end|>`, a
Python list of calls between two special tokens (read by `pythonic`); a JSON list of `{"name", "arguments"}` objects
between them, which LFM2 writes when its system prompt asks for JSON, is read too."""

from __future__ import annotations

import json

from server.tool_parsers.base import (
    BlockParser,
    FunctionCall,
    functions,
    json_calls,
    json_rule,
    ordered_pairs,
    parameter_schemas,
    parameters_schema,
)
from server.tool_parsers.pythonic import python_calls

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"


class Lfm2Parser(BlockParser):
    name = "lfm2"
    markers = (OPEN,)
    closing = CLOSE
    needs_special_tokens = True

    def read_block(self, body: str) -> tuple[FunctionCall, ...] | None:
        body = body.strip()
        try:
            return python_calls(body)
        except ValueError:
            pass
        read = json_calls(body, 0, final=True)
        return read.calls if read.calls and not body[read.end:].strip() else None

    def call_grammar(self, tools: list[dict], name: str | None) -> str | None:
        """One call in the list form, its arguments in the schema's order as JSON values (which the form reads)."""
        lines, calls = [], []
        for i, function in enumerate(functions(tools, name)):
            schema = parameters_schema(function)
            properties = parameter_schemas(schema)
            required = set(schema.get("required") or ())
            pairs = []
            for k, (key, spec) in enumerate(properties.items()):
                lines.append(f"c{i}_v{k}: {json_rule(spec)}")
                pairs.append(f'{json.dumps(key + "=")} c{i}_v{k}')
            inner = ordered_pairs(pairs, [key in required for key in properties])
            arguments = "" if inner is None else f" ({inner}){'' if required & set(properties) else '?'}"
            calls.append(f'{json.dumps(function["name"] + "(")}{arguments} ")"')
        return (f'start: {self.literal(OPEN)} "[" call "]" {self.literal(CLOSE)}\n'
                f"call: {' | '.join(f'({c})' for c in calls)}\n" + "\n".join(lines) + "\n")
