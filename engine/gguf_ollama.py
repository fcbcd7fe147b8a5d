"""Ollama's own GPT-OSS files (`general.architecture` `gptoss`, what `ollama pull gpt-oss` fetches), read as the
llama.cpp `gpt-oss` file they correspond to.

Ollama wrote GPT-OSS before llama.cpp had it, from OpenAI's checkpoint as it is (its converter,
`convert/convert_gptoss.go`, and model, `model/models/gptoss`):
- MXFP4 tensors under a type id of Ollama's own, 4, in blocks of llama.cpp's size (a scale byte, then 16 bytes of
  codes for 32 weights) but with the codes in the checkpoint's order: weight 2k in byte k's low nibble, 2k + 1 in
  its high one (llama.cpp's holds weights 0-15 in the low nibbles, 16-31 in the high ones);
- each layer's experts' gate and up in one tensor, `ffn_gate_up_exps`, rows alternating (gate, up) as GPT-OSS holds
  them, its bias alike; from OpenAI's own checkpoint also q, k and v in one tensor, `attn_qkv`;
- other names: `attn_out`, `attn_sinks` (no `.weight`), `ffn_norm` for llama.cpp's `post_attention_norm`;
- keys under `gptoss.`, without `rope.scaling.type` (YaRN whenever the scaling factor is not 1, as Ollama runs it);
- the vocabulary's split rule unnamed (`tokenizer.ggml.pre` is `default`): Ollama's model applies GPT-4o's.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

ARCH = "gptoss"
OLLAMA_MXFP4 = 4  # Ollama's type id of MXFP4 blocks in the checkpoint's code order
SPLIT_RULE = "gpt-4o"
RENAMED = {"attn_out": "attn_output", "ffn_norm": "post_attention_norm",
           # the fused gate/up stands in for gate alone: its rows already alternate as GPT-OSS holds them
           "ffn_gate_up_exps": "ffn_gate_exps"}
LAYER_TENSOR = re.compile(r"(?P<layer>blk\.\d+\.)(?P<base>[a-z_]+)(?P<suffix>\.weight|\.bias|)")


class OllamaAwareReader(GGUFReader):
    """gguf-py's reader, which also reads an Ollama GPT-OSS file, as llama.cpp's: its `tensors` under llama.cpp's
    names (`as_llama_cpp`), its MXFP4 ones (type id 4) as MXFP4 (the same bytes per weight), their names listed in
    `paired_mxfp4` (the codes in the checkpoint's order). Any other file reads as gguf-py reads it."""

    def __init__(self, path: Path) -> None:
        self._type_4: set[str] = set()  # filled while the tensor infos are read
        super().__init__(path)
        self.paired_mxfp4: set[str] = set()
        if self._is_ollamas():
            self.tensors, self.paired_mxfp4 = as_llama_cpp(self)

    def _is_ollamas(self) -> bool:
        arch = self.fields.get("general.architecture")  # a split file's later parts name none
        return arch is not None and arch.contents() == ARCH

    def _get_tensor_info_field(self, orig_offs: int):
        field = super()._get_tensor_info_field(orig_offs)
        if self._is_ollamas() and field.parts[4][0] == OLLAMA_MXFP4:
            field.parts[4] = np.array([GGMLQuantizationType.MXFP4], dtype=np.uint32)
            self._type_4.add(bytes(field.parts[1]).decode())
        return field


def as_llama_cpp(reader: OllamaAwareReader) -> tuple[list[ReaderTensor], set[str]]:
    """The file's tensors under llama.cpp's `gpt-oss` names (`attn_qkv` split into q, k and v), and the names among
    them whose MXFP4 codes are in the checkpoint's order."""
    heads, kv_heads, head_dim = (int(reader.fields[f"{ARCH}.attention.{key}"].contents())
                                 for key in ("head_count", "head_count_kv", "key_length"))
    tensors, paired = [], set()
    for tensor in reader.tensors:
        m = LAYER_TENSOR.fullmatch(tensor.name)
        if m and m["base"] == "attn_qkv":
            bounds = np.cumsum([0, heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            tensors += [_rows(tensor, start, stop, f"{m['layer']}attn_{part}{m['suffix']}")
                        for part, start, stop in zip("qkv", bounds[:-1], bounds[1:])]
            continue
        renamed = tensor  # a layer's tensor without a suffix (`attn_sinks`) is llama.cpp's `.weight`
        if m:
            renamed = tensor._replace(name=f"{m['layer']}{RENAMED.get(m['base'], m['base'])}{m['suffix'] or '.weight'}")
        if tensor.name in reader._type_4:
            paired.add(renamed.name)
        tensors.append(renamed)
    return tensors, paired


def _rows(tensor: ReaderTensor, start: int, stop: int, name: str) -> ReaderTensor:
    """Rows `start:stop` of a weight `[rows, ...]` or bias `[rows]`, as a tensor of its own (GGUF lists the rows last)."""
    shape = tensor.shape.copy()
    rows, shape[-1] = int(shape[-1]), stop - start
    return tensor._replace(name=name, shape=shape, n_elements=int(np.prod(shape)),
                           n_bytes=tensor.n_bytes // rows * (stop - start), data=tensor.data[start:stop])


def tokenizer_file(reader: OllamaAwareReader, path: Path) -> Path:
    """A GGUF file at `path` holding the file's vocabulary, chat template and special ids alone, its split rule named
    (GPT-4o's, which Ollama's model applies), for transformers' GGUF tokenizer reader, which cannot read type id 4."""
    writer = gguf.GGUFWriter(path, "gpt-oss")
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.pre":
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_tokenizer_pre(SPLIT_RULE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
