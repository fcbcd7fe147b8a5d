"""Fill-in-the-middle (code completion between a prefix and a suffix): the formats code models are trained
on, found in the tokenizer's added tokens once at load, and the prompt built from their ids.

- `qwen`: Qwen2.5/3-Coder, `<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`.
- `deepseek`: DeepSeek-Coder(-V2), `<｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>`.
- `codestral`: Mistral's v3 tokenizer, suffix first: `[SUFFIX]{suffix}[PREFIX]{prefix}`.
- `starcoder`: StarCoder(2), `<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>`.

The BOS comes first where the tokenizer adds one. The markers go in as ids, and the prefix and suffix are
encoded as plain text: code that holds a marker's text cannot make the marker itself.

Other files of the project (llama.cpp's `/infill` `input_extra`) go between the BOS and the FIM part, laid out
as llama.cpp does: the repo-level layout where the tokenizer has the format's repository and file tokens
(Qwen2.5-Coder's `<|repo_name|>myproject\n<|file_sep|>{name}\n{text}...<|file_sep|>filename\n`), else each
file's text after a plain-text separator line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# llama.cpp's placeholders: a request names neither the project nor the file being edited
REPO_NAME, CURRENT_FILE = "myproject", "filename"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # llama.cpp's, before each file where there are no file tokens
ExtraFiles = Sequence[tuple[str, str]]  # (filename, text) of other files, as context


@dataclass(frozen=True)
class FimFormat:
    """A family's markers, as text; `stops`: more of its tokens that never belong in a middle."""

    name: str
    prefix: str
    suffix: str
    middle: str | None  # None: the middle follows the last part directly (Codestral)
    suffix_first: bool = False
    stops: tuple[str, ...] = ()
    repo: str | None = None  # the repo-level layout's tokens, where the family has them
    file_sep: str | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(t for t in (self.prefix, self.suffix, self.middle) if t is not None)


FIM_FORMATS = (
    FimFormat("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
              stops=("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"),
              repo="<|repo_name|>", file_sep="<|file_sep|>"),
    FimFormat("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimFormat("codestral", "[PREFIX]", "[SUFFIX]", None, suffix_first=True, stops=("[MIDDLE]",)),
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>",
              stops=("<fim_pad>", "<repo_name>", "<file_sep>", "<filename>"),
              repo="<repo_name>", file_sep="<file_sep>"),
)


@dataclass(frozen=True)
class FimTokens:
    """A format as one tokenizer has it: its markers' ids."""

    name: str
    bos: tuple[int, ...]
    prefix: int
    suffix: int
    middle: int | None
    suffix_first: bool
    stop_ids: tuple[int, ...]  # every marker and stop token the tokenizer has: each ends a middle
    repo: int | None = None  # both None unless the tokenizer has both
    file_sep: int | None = None

    def prompt(self, prefix_ids: list[int], suffix_ids: list[int], context_ids: Sequence[int] = ()) -> list[int]:
        """`context_ids`: other files (`context_ids()`), after the BOS and before the FIM part."""
        before, after = [self.prefix, *prefix_ids], [self.suffix, *suffix_ids]
        middle = [] if self.middle is None else [self.middle]
        return [*self.bos, *context_ids, *(after + before if self.suffix_first else before + after), *middle]


def detect_fim(tokenizer) -> FimTokens | None:
    """The first format whose markers are all added tokens of `tokenizer`; None when none is."""
    added = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items()}
    for fmt in FIM_FORMATS:
        if all(marker in added for marker in fmt.markers):
            stops = [added[t] for t in fmt.markers + fmt.stops if t in added]
            repo, file_sep = added.get(fmt.repo), added.get(fmt.file_sep)
            repo_level = {"repo": repo, "file_sep": file_sep} if repo is not None and file_sep is not None else {}
            return FimTokens(fmt.name, tuple(leading_bos(tokenizer)), added[fmt.prefix], added[fmt.suffix],
                             None if fmt.middle is None else added[fmt.middle], fmt.suffix_first, tuple(stops),
                             **repo_level)
    return None


def leading_bos(tokenizer) -> list[int]:
    """[BOS] where the tokenizer starts an encoded text with it, else []."""
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos] else []


def plain_token_ids(tokenizer, text: str) -> list[int]:
    """`text` through the tokenizer's normalizer, pre-tokenizer and model only: no added or special token is
    matched in it (DeepSeek's FIM markers are added tokens that are not special, which even
    `split_special_tokens` would let through)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its special tokens at least are split
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer is not None else text
    pieces = backend.pre_tokenizer.pre_tokenize_str(normalized) if backend.pre_tokenizer is not None \
        else [(normalized, None)]
    return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


def context_ids(tokenizer, fim: FimTokens, files: ExtraFiles) -> list[int]:
    """Other files of the project as the model reads them before the FIM part (see the module's doc); none: []."""
    if not files:
        return []
    if fim.repo is None:
        return [t for _, text in files for t in plain_token_ids(tokenizer, SNIPPET_SEPARATOR + text)]
    ids = [fim.repo, *plain_token_ids(tokenizer, REPO_NAME + "\n")]
    for name, text in files:
        ids += [fim.file_sep, *plain_token_ids(tokenizer, name + "\n"), *plain_token_ids(tokenizer, text)]
    return ids + [fim.file_sep, *plain_token_ids(tokenizer, CURRENT_FILE + "\n")]


def fim_prompt_ids(tokenizer, fim: FimTokens, prefix: str, suffix: str, files: ExtraFiles = ()) -> list[int]:
    return fim.prompt(plain_token_ids(tokenizer, prefix), plain_token_ids(tokenizer, suffix),
                      context_ids(tokenizer, fim, files))
