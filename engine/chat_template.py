"""`--chat-template`: a Jinja chat template in place of the model's own (missing, broken, or without tools).

The value is a file, or else, when it holds `{%` or `{{`, the template text itself (as vLLM takes it).
It is read and its Jinja syntax checked before the model loads, so that a mistake ends the start at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jinja2

FLAG = "--chat-template"
TEMPLATE_MARKS = ("{%", "{{")


class ChatTemplateError(ValueError):
    """A --chat-template value that cannot be used; the message names the flag and the reason."""


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    origin: str  # for the log and errors: the file, or that the text was given inline


def read_chat_template(value: str) -> ChatTemplate:
    """The template `value` names or holds, its syntax checked; raises ChatTemplateError."""
    path = Path(value).expanduser()
    if _exists(path):
        template = ChatTemplate(_read_file(path), str(path))
    elif any(mark in value for mark in TEMPLATE_MARKS):
        template = ChatTemplate(value, "(template text)")
    else:
        raise ChatTemplateError(f"{FLAG} {value}: no such file (and not template text: it holds no {{% or {{{{)")
    if not template.text.strip():
        raise ChatTemplateError(f"{FLAG} {template.origin}: the template is empty")
    check_syntax(template)
    return template


def check_syntax(template: ChatTemplate) -> None:
    try:
        _compile(template.text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{FLAG} {template.origin}: Jinja syntax error on line {e.lineno}: {e.message}") \
            from None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # template text as a path: a name too long, a NUL character
        return False


def _read_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{FLAG} {path}: cannot read the file: {e}") from None


def _compile(text: str) -> None:
    try:
        # transformers' own compiler: the environment (sandbox, extensions such as {% generation %}) that renders it
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a private name: a later transformers may move it; plain sandboxed Jinja then
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment().from_string(text)
        return
    _compile_jinja_template(text)


PROCESSOR_FILES = ("chat_template.json", "processor_config.json")  # a multimodal model's processor settings


def processor_chat_template(folder: Path) -> str | None:
    """The chat template a multimodal model keeps with its processor (`chat_template.json`, or in
    `processor_config.json`) rather than with its tokenizer; None where neither holds one."""
    for name in PROCESSOR_FILES:
        try:
            template = json.loads((folder / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):  # no such file, not JSON, not an object
            continue
        if isinstance(template, str) and template.strip():
            return template
    return None
