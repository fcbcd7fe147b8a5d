"""A GGUF file's tokenizer, splitting text before its merges apply as llama.cpp does for that vocabulary.

A GGUF file names its split rule in `tokenizer.ggml.pre` and holds no regex: a reader must know each name.
transformers knows the Llama-3, Qwen2, GPT-4o and a few other names and splits the rest with GPT-2's rule,
which cuts numbers, CJK text and punctuation differently from how DeepSeek, Kimi and GLM vocabularies were
trained, so the model sees other tokens than llama.cpp gives it. The regexes below are those of llama.cpp's
vocabulary loader (the models' own `tokenizer.json` or tiktoken pattern); each is applied in turn, every match
kept as a piece of its own, before the byte-level mapping.
"""

from pathlib import Path

import gguf
from tokenizers import Regex, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# DeepSeek LLM's letters (cased letters of these blocks), as code points: some are look-alikes, such as the
# Kelvin sign, that a text tool may silently replace by their normal form.
_DEEPSEEK_LLM_LETTERS = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386),
    (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B),
    (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D),
    (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4),
    (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB),
    (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D),
    (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149), (0x214E, 0x214E), (0x2183, 0x2184),
    (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B),
    (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17),
    (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
)


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(chr(low) if low == high else f"{chr(low)}-{chr(high)}" for low, high in ranges)


_DEEPSEEK_LLM = (
    "[\r\n]",
    rf"\s?[{_char_class(_DEEPSEEK_LLM_LETTERS)}]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)

_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}")

# Kimi K2's tiktoken pattern: Han runs first; the letter runs exclude Han by class intersection (`&&`).
_KIMI_K2 = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

# Each name as llama.cpp reads it, to the regexes it applies in turn.
SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "hunyuan-dense": _DEEPSEEK_V3,
    "joyai-llm": _DEEPSEEK_V3,
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "kimi-k2": _KIMI_K2,
    "glm4": (GGUF_PRE_TOKENIZER_SPLITS["llama3"],),
    "chatglm-bpe": (GGUF_PRE_TOKENIZER_SPLITS["llama3"],),
    "hunyuan": (GGUF_PRE_TOKENIZER_SPLITS["qwen2"],),
    "grok-2": (GGUF_PRE_TOKENIZER_SPLITS["qwen2"],),
    "stablelm2": (GGUF_PRE_TOKENIZER_SPLITS["qwen2"],),
    "llama4": (GGUF_PRE_TOKENIZER_SPLITS["llama4"],),  # also for Ollama's Llama 4 files, which name none
    "smollm": (r"\p{N}", _GPT2),  # digits one by one, as SmolLM's own tokenizer splits them
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),  # Granite's, among others
    "command-r": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
    "exaone": (r"\p{N}", _GPT2),
    "minerva": (r"\p{N}", _GPT2),
}


def load_gguf_tokenizer(path: Path, reads_config: bool = True):
    """The tokenizer of the GGUF file `path`, with the file's chat template and split rule. `reads_config`: build it
    through AutoTokenizer, which reads the file's model config too (transformers must know the architecture).
    A tokenizer given a rule here is of the generic class: a model's own class (Qwen2Tokenizer, say) puts its own
    rule back when the saved tokenizer is loaded again."""
    fields = gguf.GGUFReader(path).fields
    byte_level = fields["tokenizer.ggml.model"].contents() == "gpt2"
    pre = fields["tokenizer.ggml.pre"].contents() if byte_level and "tokenizer.ggml.pre" in fields else None
    loader = AutoTokenizer if reads_config and pre not in SPLITS else PreTrainedTokenizerFast
    tokenizer = loader.from_pretrained(path.parent, gguf_file=path.name)
    if pre in SPLITS:
        apply_file_split_rule(tokenizer, pre)
    return tokenizer


def apply_file_split_rule(tokenizer, pre_name: str) -> bool:
    """Give `tokenizer` (a fast byte-level tokenizer built from a GGUF file) the split rule the file names in
    `tokenizer.ggml.pre`, where this module or transformers knows it; True if it did."""
    splits = SPLITS.get(pre_name)
    if splits is None and pre_name in GGUF_PRE_TOKENIZER_SPLITS:  # a rule transformers knows (Qwen2's, ...)
        splits = (GGUF_PRE_TOKENIZER_SPLITS[pre_name],)
    if splits is None:
        return False
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return True
