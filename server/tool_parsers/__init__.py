"""Tool-call parsers, one per output format, and the choice of one for a model."""

from __future__ import annotations

from engine.api import ChatTemplateInfo
from server.tool_parsers.base import FunctionCall, Match, ToolParser
from server.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from server.tool_parsers.gemma4 import Gemma4Parser
from server.tool_parsers.glm45 import Glm45Parser
from server.tool_parsers.granite import GraniteParser
from server.tool_parsers.harmony import HarmonyParser
from server.tool_parsers.hermes import HermesParser
from server.tool_parsers.hunyuan import HunyuanParser
from server.tool_parsers.kimi_k2 import KimiK2Parser
from server.tool_parsers.lfm2 import Lfm2Parser
from server.tool_parsers.llama4 import Llama4Parser
from server.tool_parsers.minimax_m2 import MiniMaxM2Parser
from server.tool_parsers.mistral import MistralParser
from server.tool_parsers.qwen3_coder import Qwen3CoderParser
from server.tool_parsers.stream import Piece, ToolCall, ToolCallStream

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, MistralParser, DeepSeekV3Parser, HarmonyParser, Glm45Parser, Qwen3CoderParser,
                        MiniMaxM2Parser, KimiK2Parser, Gemma4Parser, Llama4Parser, GraniteParser,
                        Lfm2Parser, HunyuanParser)
}
PARSER_NAMES = ("auto", *PARSERS)

# what a template writes when it shows the model its own call format, most specific first
_TEMPLATE_SIGNS = (
    ("<arg_key>", "glm45"),
    ("<function=", "qwen3_coder"),  # inside <tool_call>: before hermes
    ("<minimax:tool_call>", "minimax_m2"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<|tool_call|>", "granite"),
    ("<|tool_call_start|>", "lfm2"),
    ("<|tool_list_start|>", "lfm2"),
    ("<|tool_call>", "gemma4"),  # not inside `<tool_call>`, yet kept before it
    ("<tool_calls>", "hunyuan"),  # holds `<tool_call`: before hermes
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("tool▁call▁begin", "deepseek_v3"),
    ("to=functions", "harmony"),
    ("<|python_start|>", "llama4"),  # Llama 4's shipped template
    ('"parameters": dictionary of argument name', "llama4"),  # the JSON-call instruction of Llama 3.1 and 4
)
_MODEL_TYPES = {
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "mistral": "mistral", "mixtral": "mistral", "deepseek_v3": "deepseek_v3", "gpt_oss": "harmony",
    "glm4_moe": "glm45", "qwen3_5_moe": "qwen3_coder", "qwen3_5_moe_text": "qwen3_coder",
    "nemotron_h": "qwen3_coder", "minimax_m2": "minimax_m2", "kimi_k2": "kimi_k2", "kimi_linear": "kimi_k2",
    "gemma4": "gemma4", "gemma4_text": "gemma4", "llama4": "llama4", "llama4_text": "llama4",
    "granite": "granite", "granitemoe": "granite", "granitemoeshared": "granite", "lfm2": "lfm2", "lfm2_moe": "lfm2",
    "granitemoehybrid": "hermes",  # Granite 4 writes Qwen's <tool_call> blocks
    "hunyuan_v1_moe": "hunyuan",
    # multimodal models served as their text model: their language model's format
    "qwen3_vl_moe": "hermes", "glm4v_moe": "glm45", "kimi_k25": "kimi_k2", "mistral3": "mistral", "mistral4": "mistral",
    "mistral_large4": "mistral",
}


def detect_parser(info: ChatTemplateInfo) -> str | None:
    """The parser for a model: from its template's text, else from its model type; None if unknown."""
    for sign, name in _TEMPLATE_SIGNS:
        if sign in info.source:
            return name
    return _MODEL_TYPES.get(info.model_type)


__all__ = ["PARSERS", "PARSER_NAMES", "FunctionCall", "Match", "Piece", "ToolCall", "ToolCallStream",
           "ToolParser", "detect_parser"]
