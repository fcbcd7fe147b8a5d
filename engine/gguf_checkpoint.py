"""GGUF files (llama.cpp's and Ollama's format), served by converting them once into a Hugging Face folder.

A GGUF model (one file or the parts of a split one, found by `engine.gguf_sources`) comes here. The file's
config, tokenizer and chat template are read by transformers' GGUF support; its dense tensors are read one at a
time (memory-mapped by gguf-py), dequantized by a pool of threads, renamed to the model's parameters by
transformers' GGUF name maps and written as safetensors shards into the per-user state folder. The experts, most
of the model, stay in the GGUF file and are read from there (`engine.gguf_experts`): stored once in the form
`--expert-dtype` asks for (`auto` keeps a 4- or 8-bit file's experts that small) and cached like those of any
checkpoint. A later start finds the folder by the files' paths, sizes and modification times and loads it at once.
Ollama's own GPT-OSS files are read as llama.cpp's (`engine.gguf_ollama`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file
from transformers import (
    AfmoeConfig,
    AutoConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Dots1Config,
    Ernie4_5_MoeConfig,
    Gemma4TextConfig,
    GenerationConfig,
    Glm4MoeConfig,
    GlmMoeDsaConfig,
    GptOssConfig,
    GraniteMoeConfig,
    GraniteMoeHybridConfig,
    GraniteMoeSharedConfig,
    HunYuanMoEV1Config,
    JambaConfig,
    Lfm2MoeConfig,
    Llama4TextConfig,
    MiMoV2FlashConfig,
    Mistral4Config,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen3MoeConfig,
    Step3p7TextConfig,
)
from transformers.core_model_loading import Concatenate, WeightConverter, rename_source_key
from transformers.integrations.gguf import get_gguf_conversion_mapping, is_gguf_arch_supported
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    LlamaTensorProcessor,
    Qwen2MoeTensorProcessor,
    TensorProcessor,
    get_gguf_hf_weights_map,
)

from cache.quant_store import check_free_space
from cache.safetensors_index import CheckpointError
from engine import gguf_kimi_linear, gguf_nemotron_h, gguf_ollama
from engine.gguf_experts import (
    MARKER,
    ExpertTensor,
    expert_tensor,
    held_as,
    out_in,
    read_marker,
    recorded_experts,
)
from engine.gguf_nemotron_h import per_layer
from engine.gguf_qwen3next import Qwen3NextNames, qwen3next_config
from engine.gguf_sources import split_parts
from engine.gguf_tokenizer import apply_file_split_rule, load_gguf_tokenizer
from engine.moe_layers import find_moe_layers, interface_families
from engine.multimodal import build_text_model
from engine.paths import default_gguf_folder

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # part of the folder's identity: a new version converts again
SHARD_BYTES = 2 << 30
DONE_MARKER = MARKER  # written last: a folder without it is an interrupted conversion

# the GGUF architectures whose conversion is tested token for token (`llama`: Mixtral, a llama with experts;
# `gptoss`: Ollama's GPT-OSS, read as llama.cpp's `gpt-oss`, `engine.gguf_ollama`)
CONVERTED_ARCHS = ("qwen3moe", "qwen2moe", "llama", "qwen35moe", "gpt-oss", gguf_ollama.ARCH, "minimax-m2",
                   "deepseek2", "glm4moe", "gemma4", "ernie4_5-moe", "dots1", "llama4", "olmoe", "granitemoe",
                   "qwen3next", "lfm2moe", "granitehybrid", "hunyuan-moe", "jamba", "qwen3vlmoe", gguf_nemotron_h.ARCH,
                   "mistral4", "glm-dsa", "afmoe", gguf_kimi_linear.ARCH, "mimo2", "step35")
# architectures whose config transformers does not read from a GGUF file
OWN_CONFIG_ARCHS = ("deepseek2", "glm4moe", "ernie4_5-moe", "dots1", "llama4", "olmoe", "granitemoe", "qwen3next",
                    "lfm2moe", "granitehybrid", "hunyuan-moe", "jamba", "qwen3vlmoe", gguf_nemotron_h.ARCH, "mistral4",
                    "glm-dsa", "afmoe", gguf_kimi_linear.ARCH, "mimo2", "step35")
# llama.cpp's LlamaModel and its children reorder q/k rows for its rotary
PERMUTED_QK_ARCHS = ("llama", "granitemoe", "granitehybrid", gguf_nemotron_h.ARCH)
# the split rule Ollama's model applies where its file leaves the rule unnamed (`default`): Llama 4's own; Qwen2's, in
# Ollama's Nemotron-H model
OLLAMA_SPLIT_RULES = {"llama4": "llama4", gguf_nemotron_h.ARCH: "qwen2"}
# tensor names Ollama's converter gives otherwise than llama.cpp's, by architecture: llama.cpp's part → Ollama's
OLLAMA_NAMES = {"lfm2moe": {"token_embd_norm": "output_norm"},  # LFM2's final norm, `embedding_norm` in its checkpoint
                gguf_nemotron_h.ARCH: gguf_nemotron_h.OLLAMA_NAMES}
LLAMA3_ORIGINAL_CONTEXT = 8192  # what llama.cpp's converter assumes where a config names none
# Expert sizes that transformers' GGUF config reader leaves at the class default: GGUF key → config attribute
MISSED_CONFIG_KEYS = {
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}


# bits per weight of GGUF's quantized types, rounded down to the nearest form moe-serve has (4 or 8)
GGUF_BITS = {**dict.fromkeys(("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                              "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4", "TQ1_0", "TQ2_0"), 4),
             **dict.fromkeys(("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"), 8)}
END_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# tokens that end a turn which a family's files do not name; llama.cpp finds them by their text at load
TURN_END_TOKENS = {"gpt_oss": ("<|return|>", "<|call|>"),  # GPT-OSS: a final answer, a tool call (eos: the first)
                   "gemma4_text": ("<turn|>", "<|tool_response>"),  # Gemma 4: a turn's end, a call awaiting its result
                   "llama4_text": ("<|eot|>", "<|eom|>")}  # Llama 4: a turn's end, a message awaiting a tool's result
DEQUANTIZE_THREADS = min(8, os.cpu_count() or 1)
SOFTMAX_GATING, SIGMOID_GATING = 1, 2  # llama.cpp's `expert_gating_func`
NEEDED = object()  # `arch_keys`: a key asked for without a default
# llama.cpp's afmoe leaves every fourth layer unrotated (fixed in its graph) and, unless the file names another period,
# attends in full there; transformers' AFMoE rotates exactly its sliding layers
AFMOE_PERIOD = 4
# the router keys llama.cpp's mimo2 loader leaves unread, and the values its graph runs whatever they say (a sigmoid,
# top-k weights renormalised and not scaled), as transformers' MiMo-V2-Flash does: any other value is refused
MIMO2_ROUTER = {"expert_gating_func": (SIGMOID_GATING, 0), "expert_weights_norm": (True,),
                "expert_weights_scale": (1.0, 0.0)}
# MiMo-V2-Flash's attention_value_scale (sqrt(4096 / (64 heads × 128)), transformers' default for the family), which
# llama.cpp's converter writes as `attention.value_scale` since May 2026; before, it converted that model alone
MIMO_V2_FLASH_VALUE_SCALE = 0.707
MISTRAL4_SCALING_BETA = 0.1  # Mistral Small 4's `llama_4_scaling_beta` (and transformers' default for the family)
# the `glm-dsa.*` keys GLM-5's config is read from, all of which llama.cpp's converter writes and its loader requires
GLM_DSA_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
                "expert_feed_forward_length", "expert_count", "expert_used_count", "attention.head_count",
                "attention.layer_norm_rms_epsilon", "attention.q_lora_rank", "attention.kv_lora_rank",
                "attention.key_length", "attention.value_length", "rope.dimension_count",
                "attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k")
GLM_5_2_CONTEXT = 1 << 20  # llama.cpp takes a file of this context or more that names no indexer types for GLM-5.2
# a layer's experts merged (`ffn_gate_exps`), or one tensor per expert (`ffn_gate.3`: files from before 2024); their
# biases where the family has them (GPT-OSS); gate and up fused as the model holds them (Gemma 4's `ffn_gate_up_exps`)
EXPERT_TENSOR = re.compile(
    r"blk\.(?P<layer>\d+)\.ffn_(?P<weight>gate_up|gate|up|down)(?:_exps|\.(?P<expert>\d+))\.(?P<kind>weight|bias)")
WEIGHT_ORDER = ("gate_up", "gate", "up", "down")  # gate_up_proj: gate's rows first
# Gemma 4's router scales, which llama.cpp names after the tensors they scale: the router's input, each expert's output
ROUTER_SCALE = re.compile(r"blk\.(?P<layer>\d+)\.(?P<scaled>ffn_gate_inp|ffn_down_exps)\.scale")
DT_BIAS = re.compile(r"blk\.(?P<layer>\d+)\.ssm_dt\.bias")
ROUTER = re.compile(r"blk\.(?P<layer>\d+)\.ffn_gate_inp\.weight")
ROUTER_BIAS = re.compile(r"blk\.(?P<layer>\d+)\.exp_probs_b\.bias")  # DeepSeek-V3's e_score_correction_bias


def gguf_folder(source: Path) -> Path:
    """The Hugging Face folder converted from the GGUF file `source` (converted now unless an earlier start did).

    `source` may be any part of a model split by llama.cpp's gguf-split (`NAME-00001-of-00003.gguf`): all parts
    are converted together.
    """
    parts = split_parts(source.expanduser().absolute())  # not resolved: the hub cache links parts to blobs
    identity = "|".join(f"{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in parts)  # with the folder's path
    folder = default_gguf_folder(parts[0], f"{identity}|v{CONVERTER_VERSION}")
    if (folder / DONE_MARKER).is_file():
        log.info("GGUF %s: using its conversion in %s", parts[0], folder)
        _hint_if_it_holds_the_experts(folder)
        return folder
    partial = folder.with_name(f"{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted conversion: start over
    partial.mkdir(parents=True)
    try:
        convert_gguf(parts, partial, identity)
        if folder.exists():  # another process converted the same file meanwhile
            shutil.rmtree(partial)
        else:
            partial.rename(folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return folder


def _hint_if_it_holds_the_experts(folder: Path) -> None:
    """A conversion made before the experts stayed in the GGUF file still serves, from its float16 copy of them."""
    if "experts" in read_marker(folder):
        return
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    log.warning("GGUF: %s holds a float16 copy of the experts (%.1f GiB), as conversions before 2026-12-02 did; "
                "delete that folder to reclaim the space: the next start converts again and reads the experts from the "
                "GGUF file", folder, size / 2**30)


def convert_gguf(parts: list[Path], out: Path, identity: str = "") -> None:
    """Write the config, tokenizer, generation config and weights of the GGUF file `parts` (one, or the parts
    of a split model) into the empty folder `out`.

    Each tensor keeps its float type (F32, F16, BF16); a quantized one is dequantized into float16, which holds
    its values (fp16 scales times small integers) more closely than bf16. One-dimensional tensors (norms,
    biases) are float32. The config's dtype, the compute dtype `--dtype auto` picks on a GPU, is float32 if the
    file's matrices all are, else bfloat16. Expert tensors (`ffn_{gate,up,down}_exps`) stay in the file: the
    marker records where each lies (`engine.gguf_experts`), for the model's fused `gate_up_proj [E, 2I, H]`
    (gate rows first) and `down_proj [E, H, I]`. `identity`: the files' sizes and times, for the marker.
    """
    source = parts[0]
    try:
        readers = [gguf_ollama.OllamaAwareReader(part) for part in parts]
        arch = architecture(readers)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{source} is not a readable GGUF file: {type(e).__name__}: {e}") from None
    if any(reader.byte_order != "I" for reader in readers):
        raise CheckpointError(f"{source} is a GGUF file of the other byte order (big-endian), which moe-serve does "
                              f"not read")
    tensors = [(tensor, part) for reader, part in zip(readers, parts) for tensor in reader.tensors]
    paired = set().union(*(reader.paired_mxfp4 for reader in readers))  # Ollama's MXFP4
    _check_paired_are_experts(source, paired)
    config = gguf_config(source, readers[0], arch, {t.name for t, _ in tensors})
    config.tie_word_embeddings = all(t.name != "output.weight" for t, _ in tensors)  # in any part
    matrices = [t for t, _ in tensors if len(t.shape) > 1]
    config.dtype = torch.float32 if all(t.tensor_type.name == "F32" for t in matrices) else torch.bfloat16
    check_free_space(out.parent, sum(int(t.n_elements) * storage_dtype(t).itemsize for t, _ in tensors
                                     if not EXPERT_TENSOR.fullmatch(t.name)), "converting this GGUF file")
    with init_empty_weights(include_buffers=False):
        model = build_text_model(config, config.dtype)  # Mistral 4's causal LM: only as transformers' multimodal kind
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}

    names_arch = "gpt-oss" if arch == gguf_ollama.ARCH else arch
    if arch == "step35":  # a composite's language model, which transformers' GGUF name maps do not reach
        names = Step35Names()
    elif is_gguf_arch_supported(names_arch):
        names = MappedNames(names_arch, config, [t.name for t, _ in tensors])
    else:
        names = LegacyNames(names_arch, config, model)
    if arch == "qwen3next":  # its converter changes the linear attention: undone around the common map
        names = Qwen3NextNames(config, names)
    if arch == gguf_kimi_linear.ARCH:  # likewise: its conv kernels apart, its forget gate renamed
        names = gguf_kimi_linear.KimiLinearNames(source, config, names, [t.name for t, _ in tensors])
    moe_layers = find_moe_layers(model)
    if not moe_layers:  # a family with dense and MoE variants (Gemma 4's E4B, 31B)
        raise CheckpointError(f"{source}: a dense {config.model_type!r} model ({arch!r} in GGUF), with no experts: "
                              f"moe-serve serves Mixture-of-Experts models")
    transposed, interleaved = held_as(moe_layers[0].experts)  # GPT-OSS: both
    target_of = {t.name: target if (target := names.target(t.name)) in expected else None for t, _ in tensors}
    _check_complete(source, set(filter(None, target_of.values())), expected, config)  # before any work, not after
    weights_of = defaultdict(set)  # expert parameter → the weights making it: gate_up_proj {gate, up}
    for t, _ in tensors:
        if target_of[t.name] and (m := EXPERT_TENSOR.fullmatch(t.name)):
            weights_of[target_of[t.name]].add(m["weight"])
    experts = defaultdict(lambda: defaultdict(dict))  # expert parameter → weight → first expert → its file tensor
    writer = ShardWriter(out)
    started, unused = time.monotonic(), []
    log.info("GGUF %s (%s, %d tensors in %d files): converting into %s, once", source, arch, len(tensors),
             len(parts), out)
    with ThreadPoolExecutor(DEQUANTIZE_THREADS) as pool:
        for i, (tensor, file) in enumerate(tensors):
            target = target_of[tensor.name]
            if target is None:
                unused.append(tensor.name)
            elif m := EXPERT_TENSOR.fullmatch(tensor.name):
                names.check_expert(tensor.name)
                experts[target][m["weight"]][int(m["expert"] or 0)] = _expert_tensor(
                    source, tensor, file, target, expected, len(weights_of[target]), transposed, tensor.name in paired)
            elif (weights := names.convert(tensor.name, dequantize_parallel(tensor, pool))) is not None:
                writer.add(target, _unsqueezed(weights, expected[target]).contiguous().to(storage_dtype(tensor)),
                           expected)  # None: half kept
            if (i + 1) % 50 == 0:
                log.info("GGUF: %d of %d tensors, %.1f GiB written, %.0f s", i + 1, len(tensors),
                         writer.bytes_written / 2**30, time.monotonic() - started)
    writer.close()
    if unused:
        log.warning("GGUF %s: %d tensors not used by %s (%s)", source, len(unused), config.model_type,
                    ", ".join(unused[:5]))
    _save_companions(source, readers[0], arch, config, out)
    marker = {"source": [str(part) for part in parts], "architecture": arch, "converter": CONVERTER_VERSION,
              "identity": identity, "expert_types": _expert_types([t for t, _ in tensors if target_of[t.name]]),
              "in_place": not (transposed or interleaved),
              "experts": recorded_experts({target: [_runs(source, target, by_weight[w], expected[target][0])
                                                    for w in WEIGHT_ORDER if w in by_weight]
                                           for target, by_weight in experts.items()})}
    (out / DONE_MARKER).write_text(json.dumps(marker))
    log.info("GGUF %s: converted in %.0f s (%.1f GiB)", source, time.monotonic() - started,
             writer.bytes_written / 2**30)


def _unsqueezed(weights: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`weights` in the model's `shape` where llama.cpp's converter dropped its axes of size 1 (ERNIE's router bias,
    `[1, E]` in the model, `[E]` in the file)."""
    if weights.shape != shape and [d for d in weights.shape if d != 1] == [d for d in shape if d != 1]:
        return weights.reshape(shape)
    return weights


def _check_paired_are_experts(source: Path, paired: set[str]) -> None:
    """Ollama's MXFP4 tensors are read in place as experts only: a dense one would be decoded in llama.cpp's order."""
    dense = sorted(name for name in paired if not EXPERT_TENSOR.fullmatch(name))
    if dense:
        raise CheckpointError(f"{source}: Ollama's MXFP4 tensors {', '.join(dense[:3])} are not experts, which is "
                              f"all moe-serve reads in that form")


def _expert_tensor(source: Path, tensor, file: Path, target: str, expected: dict[str, tuple], parts: int,
                   transposed: bool, paired: bool = False) -> ExpertTensor:
    """Where a merged expert tensor lies in `file`, checked against the shape of the model's parameter `target`
    (`[E, ...]`, `transposed`: `[E, in, out]`), of which it is one of `parts` (gate_up: gate, up)."""
    rows, columns = out_in(expected[target][1:], transposed)
    found = expert_tensor(tensor, file, paired)
    if found.shape[1:] != (rows // parts, columns):
        raise CheckpointError(f"{source}: {tensor.name} has rows of shape {list(found.shape[1:])}, the model expects "
                              f"{[rows // parts, columns]} of {target}")
    return found


def _runs(source: Path, target: str, by_first_expert: dict[int, ExpertTensor], experts: int) -> list[ExpertTensor]:
    """One weight's tensors in expert order (one merged tensor, or one per expert), checked to hold every expert."""
    firsts = sorted(by_first_expert)
    runs = [by_first_expert[e] for e in firsts]
    if firsts not in ([0], list(range(experts))) or sum(t.shape[0] for t in runs) != experts:
        raise CheckpointError(f"{source}: the tensors of {target} hold {sum(t.shape[0] for t in runs)} experts, "
                              f"the model has {experts}")
    return runs


class LegacyNames:
    """GGUF tensor → our parameter by transformers' older GGUF reader: its name map and tensor processors (which
    undo, for a llama, llama.cpp's permuted q/k rows), and what that map lacks: experts and a router's correction
    bias by the model's own MoE layers, and DeepSeek's `kv_b_proj` from the two tensors llama.cpp splits it into."""

    def __init__(self, arch: str, config: PretrainedConfig, model: torch.nn.Module) -> None:
        processor_class = MixtralTensorProcessor if config.model_type == "mixtral" else TENSOR_PROCESSORS.get(arch)
        if processor_class is None and arch in PERMUTED_QK_ARCHS:
            processor_class = LlamaTensorProcessor
        self.processor = (processor_class or TensorProcessor)(config=config.to_dict())
        self.names = get_gguf_hf_weights_map(model, self.processor, model_type=arch)  # merged: no `.weight`
        if arch == gguf_nemotron_h.ARCH:
            self.names.update(gguf_nemotron_h.published_names(model, config.num_hidden_layers))
        self.names.update(with_ollama_names(self.names, OLLAMA_NAMES.get(arch, {})))
        layers = find_moe_layers(model)
        self.experts = {layer.decoder_layer: layer.path for layer in layers}
        self.up_names = {layer.decoder_layer: "gate_up_proj" if getattr(layer.experts, "has_gate", True) else "up_proj"
                         for layer in layers}  # Nemotron-H's experts have no gate
        module_names = {module: name for name, module in model.named_modules()}
        self.routers = {layer.decoder_layer: f"{module_names[layer.router]}.weight" for layer in layers
                        if layer.router is not None and hasattr(layer.router, "weight")}
        self.router_biases = {int(m[1]): name for name in model.state_dict()  # LFM2's: `expert_bias`
                              if (m := re.search(r"layers\.(\d+)\..*(e_score_correction|expert)_bias$", name))}
        self.kv_b = SplitKVB(config)
        self.shared_input = SplitSharedInput(model)
        self.dt_biases = {int(m[1]): name for name in model.state_dict()
                          if (m := re.search(r"layers\.(\d+)\..*\.dt_bias$", name))}

    def target(self, name: str) -> str | None:
        """Our parameter for a GGUF tensor; a per-expert one (`ffn_gate.3`) maps as its layer's merged tensor, and
        an expert tensor the name map lacks (GPT-OSS's) to its layer's fused parameter."""
        m = EXPERT_TENSOR.fullmatch(name)
        if m and m["expert"] is not None:
            name = f"blk.{m['layer']}.ffn_{m['weight']}_exps.{m['kind']}"
        found = self.names.get(name) or self.names.get(name.removesuffix(".weight"))
        if found is None and m and int(m["layer"]) in self.experts:
            fused = "down_proj" if m["weight"] == "down" else self.up_names[int(m["layer"])]
            found = f"{self.experts[int(m['layer'])]}.{fused}{'_bias' if m['kind'] == 'bias' else ''}"
        if found is None and (bias := ROUTER_BIAS.fullmatch(name)):
            found = self.router_biases.get(int(bias["layer"]))
        if found is None and (half := SplitKVB.HALF.fullmatch(name)):
            found = self.names.get(f"blk.{half['layer']}.attn_kv_b.weight")
        if found is None and (router := ROUTER.fullmatch(name)):  # a router the name map lacks (Granite's)
            found = self.routers.get(int(router["layer"]))
        if found is None and (dt := DT_BIAS.fullmatch(name)):  # a state-space layer's, renamed by llama.cpp
            found = self.dt_biases.get(int(dt["layer"]))
        if found is None:
            found = self.shared_input.target(name)
        if found is None and (scale := ROUTER_SCALE.fullmatch(name)):  # beside the router's `proj.weight`
            router = self.names.get(f"blk.{scale['layer']}.ffn_gate_inp.weight", "").removesuffix("proj.weight")
            found = router and router + ("scale" if scale["scaled"] == "ffn_gate_inp" else "per_expert_scale")
        return found

    def convert(self, name: str, weights: np.ndarray) -> torch.Tensor | None:
        if SplitKVB.HALF.fullmatch(name):
            return self.kv_b.join(name, torch.from_numpy(weights))
        if self.shared_input.target(name):
            return self.shared_input.join(name, torch.from_numpy(weights))
        if name.endswith(".ssm_a"):  # a state-space layer's A, stored as -exp(A_log) (Mamba-2's as [H, 1])
            return torch.log(-torch.from_numpy(weights))
        if name.endswith(".ssm_norm.weight"):  # Mamba-2's gated norm, stored in groups
            return torch.from_numpy(weights).reshape(-1)
        return torch.from_numpy(np.ascontiguousarray(self.processor.process(weights=weights, name=name).weights))

    def check_expert(self, name: str) -> None:
        """Experts are read from the file as they lie: this reader changes none."""


def with_ollama_names(names: dict[str, str], renamed: dict[str, str]) -> dict[str, str]:
    """The tensors of `names` (GGUF name → our parameter) whose name has a part Ollama names otherwise (`renamed`:
    llama.cpp's part → Ollama's), under Ollama's name."""
    found = {}
    for name, ours in names.items():
        parts = name.split(".")
        if any(part in renamed for part in parts):
            found[".".join(renamed.get(part, part) for part in parts)] = ours
    return found


class SplitKVB:
    """DeepSeek's `kv_b_proj` `[heads × (nope + v), kv_lora]`, which llama.cpp writes since 2025 as two tensors for
    MLA's absorbed form: `attn_k_b` `[heads, kv_lora, nope]` (each head's nope rows transposed) and `attn_v_b`
    `[heads, v, kv_lora]`. The first of a layer's two is kept until the second comes."""

    HALF = re.compile(r"blk\.(?P<layer>\d+)\.attn_(?P<half>k|v)_b\.weight")

    def __init__(self, config: PretrainedConfig) -> None:
        self.heads = getattr(config, "num_attention_heads", 0)
        self.pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)

    def join(self, name: str, weights: torch.Tensor) -> torch.Tensor | None:
        """`kv_b_proj` once both of its layer's halves came, None before."""
        m = self.HALF.fullmatch(name)
        halves = self.pending[m["layer"]]
        halves[m["half"]] = weights.reshape(self.heads, *weights.shape[-2:])
        if len(halves) < 2:
            return None
        del self.pending[m["layer"]]
        joined = torch.cat([halves["k"].transpose(1, 2), halves["v"]], dim=1)  # [heads, nope + v, kv_lora]
        return joined.reshape(-1, joined.shape[-1])


class SplitSharedInput:
    """Granite's shared expert input `shared_mlp.input_linear` `[2S, H]` (gate rows first), which llama.cpp writes as
    `ffn_gate_shexp` and `ffn_up_shexp`. The first of a layer's two is kept until the second comes."""

    HALF = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<half>gate|up)_shexp\.weight")

    def __init__(self, model: torch.nn.Module) -> None:
        self.targets = {int(m[1]): name for name in model.state_dict()
                        if (m := re.search(r"layers\.(\d+)\.shared_mlp\.input_linear\.weight$", name))}
        self.pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)

    def target(self, name: str) -> str | None:
        m = self.HALF.fullmatch(name)
        return self.targets.get(int(m["layer"])) if m else None

    def join(self, name: str, weights: torch.Tensor) -> torch.Tensor | None:
        """`input_linear` once both of its layer's halves came, None before."""
        m = self.HALF.fullmatch(name)
        halves = self.pending[m["layer"]]
        halves[m["half"]] = weights
        if len(halves) < 2:
            return None
        del self.pending[m["layer"]]
        return torch.cat([halves["gate"], halves["up"]])


class MappedNames:
    """GGUF tensor → our parameter by transformers' GGUF conversion mapping (`integrations.gguf`): renamings, and
    converters that undo llama.cpp's changes to a tensor (norms stored as w + 1, reordered heads, ...)."""

    def __init__(self, arch: str, config: PretrainedConfig, tensor_names: list[str]) -> None:
        mapping = get_gguf_conversion_mapping(arch, config)
        renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        self.targets, self.converters = {}, {}
        for name in tensor_names:  # each once: asking a renaming marks it used, as transformers' loader does
            self.targets[name], pattern = rename_source_key(name, renamings, converters)
            self.converters[name] = next((c for c in converters if pattern in c.source_patterns), None)

    def target(self, name: str) -> str | None:
        return self.targets.get(name)

    def convert(self, name: str, weights: np.ndarray) -> torch.Tensor:
        tensor, converter = torch.from_numpy(weights), self.converters[name]
        for op in converter.operations if converter else ():
            out = op.convert({name: [tensor]}, source_patterns=converter.source_patterns,
                             target_patterns=converter.target_patterns, full_layer_name=self.targets[name])
            (tensor,) = out.values()
        return tensor

    def check_expert(self, name: str) -> None:
        """Experts are read from the file as they lie: refuse a mapping that would change more than their order
        (gate's rows, then up's)."""
        converter = self.converters[name]
        if converter and not all(isinstance(op, Concatenate) and op.dim == 1 for op in converter.operations):
            raise CheckpointError(f"GGUF {name}: transformers converts it with {converter.operations}, which "
                                  f"moe-serve cannot read in place")


def dequantize_parallel(tensor, pool: ThreadPoolExecutor) -> np.ndarray:
    """A GGUF tensor as float32 `[..., columns]`, its rows decoded by `pool`'s threads (numpy releases the GIL)."""
    from gguf import dequantize

    data = tensor.data  # [..., row bytes] memory-mapped; a float type's values as they are
    out = np.empty((*data.shape[:-1], int(tensor.shape[0])), dtype=np.float32)  # GGUF shapes list columns first
    flat_in, flat_out = data.reshape(-1, data.shape[-1]), out.reshape(-1, out.shape[-1])
    step = max(1, -(-len(flat_in) // (4 * DEQUANTIZE_THREADS)))

    def decode(start: int) -> None:
        flat_out[start:start + step] = dequantize(flat_in[start:start + step], tensor.tensor_type)

    list(pool.map(decode, range(0, len(flat_in), step)))
    return out


def architecture(readers: list) -> str:
    """The architecture the GGUF file (`readers`: of each part) is converted as: the one it names, but Qwen3-Next's
    for Ollama's Qwen3-Next files, which Ollama writes under Qwen3.5's name (`qwen35moe`) in Qwen3-Next's layout: its
    linear attention's beta and alpha projections fused (`ssm_ba`; Qwen3.5 has two) and no value heads reordered."""
    named = str(readers[0].fields["general.architecture"].contents())
    if named == "qwen35moe" and any(t.name.endswith(".ssm_ba.weight") for r in readers for t in r.tensors):
        return "qwen3next"
    return named


def gguf_config(source: Path, reader, arch: str, tensor_names: set[str]) -> PretrainedConfig:
    """The model's config as transformers reads it from the file, with the expert sizes it misses; read here for
    the architectures whose config transformers reads wrongly (GPT-OSS's YaRN) or not at all (DeepSeek's)."""
    if arch not in CONVERTED_ARCHS:
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not one moe-serve converts (it converts "
                              f"{', '.join(CONVERTED_ARCHS)}); serve the model's Hugging Face checkpoint instead")
    if arch in ("gpt-oss", gguf_ollama.ARCH):  # transformers' GGUF reader fails on its YaRN keys
        return gpt_oss_config(reader, arch)
    if arch in ("deepseek2", "mistral4"):  # transformers reads no config of these; Mistral 4 is DeepSeek's layout
        return deepseek2_config(reader, arch)
    if arch == "glm-dsa":
        return glm_dsa_config(source, reader)
    if arch == "glm4moe":
        return glm4moe_config(reader, tensor_names)
    if arch == "gemma4":  # transformers reads neither its experts nor its rotary settings
        return gemma4_config(reader, tensor_names)
    if arch == "ernie4_5-moe":
        return ernie4_5_moe_config(reader, tensor_names)
    if arch == "dots1":
        return dots1_config(reader)
    if arch == "afmoe":
        return afmoe_config(source, reader)
    if arch == "mimo2":
        return mimo2_config(source, reader, tensor_names)
    if arch == "step35":
        return step35_config(source, reader, tensor_names)
    if arch == "llama4":
        return llama4_config(source, reader)
    if arch == "olmoe":
        return olmoe_config(reader)
    if arch == "granitemoe":
        return granitemoe_config(reader)
    if arch == "granitehybrid":
        return granitehybrid_config(reader, tensor_names)
    if arch == "qwen3next":  # llama.cpp's, or Ollama's under Qwen3.5's name and keys
        return qwen3next_config(reader, arch_keys(reader, str(reader.fields["general.architecture"].contents())))
    if arch == "lfm2moe":
        return lfm2moe_config(reader, tensor_names)
    if arch == "hunyuan-moe":
        return hunyuan_moe_config(reader)
    if arch == "jamba":
        return jamba_config(source, reader, tensor_names)
    if arch == "qwen3vlmoe":
        return qwen3vlmoe_config(reader)
    if arch == gguf_nemotron_h.ARCH:
        key = arch_keys(reader, arch)
        return gguf_nemotron_h.nemotron_h_config(reader, key, _sizes(key, reader), tensor_names)
    if arch == gguf_kimi_linear.ARCH:  # DeepSeek's MLA and MoE keys beside those of its linear attention
        key = arch_keys(reader, arch)
        _check_keys(source, key, arch, gguf_kimi_linear.KEYS, "Kimi-Linear's")
        return gguf_kimi_linear.kimi_linear_config(source, key, _mla_keys(reader, key))
    try:
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not one transformers reads ({e}); "
                              f"serve the model's Hugging Face checkpoint instead") from None
    if arch == "llama" and f"{arch}.expert_count" in reader.fields:
        config = mixtral_config(config, reader)
    for key, attribute in MISSED_CONFIG_KEYS.get(arch, {}).items():
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            setattr(config, attribute, int(field.contents()))
        elif key == "expert_feed_forward_length":  # Ollama's Qwen3 files leave it out
            setattr(config, attribute, expert_width(reader))
    if config.model_type not in interface_families():
        raise CheckpointError(f"{source}: a {config.model_type!r} model ({arch!r} in GGUF), not a Mixture-of-Experts "
                              f"family moe-serve serves ({', '.join(interface_families())})")
    return config


def arch_keys(reader, arch: str, source: Path | None = None) -> Callable[..., Any]:
    """`key(name, default=None)`: the value of the file's `{arch}.{name}`, or `default` where it has none; given the
    file's `source`, a key asked for without a default is needed, and a file without it is refused by its name."""

    def key(name: str, default=NEEDED):
        field = reader.fields.get(f"{arch}.{name}")
        if field is not None:
            return field.contents()
        if default is NEEDED and source is not None:
            raise CheckpointError(f"{source}: the GGUF file has no `{arch}.{name}`, which its model needs")
        return None if default is NEEDED else default

    return key


def gpt_oss_config(reader, arch: str = "gpt-oss") -> GptOssConfig:
    """GPT-OSS's config from the keys llama.cpp writes (Ollama's, under `gptoss`, alike); what they leave out is
    GPT-OSS's own (its SwiGLU clamp, sliding and full attention alternating from the first layer, YaRN's betas).
    Ollama names no scaling type: it runs YaRN whenever the factor is not 1."""
    key = arch_keys(reader, arch)
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 150000.0))}
    ollama_yarn = arch == gguf_ollama.ARCH and float(key("rope.scaling.factor", 1.0)) != 1.0
    if key("rope.scaling.type") == "yarn" or ollama_yarn:
        rope = {**GptOssConfig().rope_parameters, **rope, "rope_type": "yarn",
                "factor": float(key("rope.scaling.factor")),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length"))}
        for beta in ("beta_fast", "beta_slow"):
            rope[beta] = float(key(f"rope.scaling.yarn_{beta}", rope[beta]))
    return GptOssConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("expert_feed_forward_length", key("feed_forward_length"))),
        num_hidden_layers=int(key("block_count")), num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")), head_dim=int(key("attention.key_length")),
        num_local_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        sliding_window=int(key("attention.sliding_window")), max_position_embeddings=int(key("context_length")),
        rope_parameters=rope)


def deepseek2_config(reader, arch: str = "deepseek2") -> DeepseekV2Config | DeepseekV3Config | Mistral4Config:
    """DeepSeek-V2 or -V3 (and the models llama.cpp writes in their layout) from its `deepseek2` keys: a sigmoid
    router (gating function 2) is V3's, with its correction bias; a softmax one V2's. `mistral4` (Mistral Small 4) is
    written by llama.cpp as DeepSeek-V2 under its own name: read as Mistral 4, whose queries are also scaled beyond the
    original context (Llama 4's scaling)."""
    key = arch_keys(reader, arch)
    common = _mla_keys(reader, key)
    if arch == "mistral4":  # llama.cpp writes no Llama 4 scaling for it: Mistral's own 0.1 where the file has none
        common["rope_parameters"]["llama_4_scaling_beta"] = float(
            key("attention.temperature_scale", MISTRAL4_SCALING_BETA))
        qk_head = common["qk_nope_head_dim"] + common["qk_rope_head_dim"]
        return Mistral4Config(**(common | {"head_dim": qk_head}))  # its head: nope + rope, rotary on the rope part
    if int(key("expert_gating_func", SOFTMAX_GATING)) == SIGMOID_GATING:
        return DeepseekV3Config(**common)
    return DeepseekV2Config(**common, topk_method="group_limited_greedy" if common["n_group"] > 1 else "greedy")


def _mla_keys(reader, key: Callable[..., Any]) -> dict[str, Any]:
    """The settings of DeepSeek's MLA attention (and its MoE, `_deepseek_style_keys`) as llama.cpp writes them for
    every model of that layout (`key`: the file's `arch_keys`), YaRN included. Files since 2025 describe attention in
    MLA's absorbed form (one KV head of `kv_lora + rope` dimensions); the model's own head sizes are then the `*_mla`
    keys."""
    rope_dim, heads = int(key("rope.dimension_count")), int(key("attention.head_count"))
    mla = key("attention.key_length_mla") is not None
    qk_head = int(key("attention.key_length_mla" if mla else "attention.key_length"))
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    if key("rope.scaling.type") == "yarn":
        mscale = round(float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)  # stored: 0.1 × mscale_all_dim
        rope |= {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                 "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
                 "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                 "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)), "mscale": mscale,
                 "mscale_all_dim": mscale}
    q_lora_rank = key("attention.q_lora_rank")  # none (Ollama's files: 0): queries projected at once (V2-Lite)
    return dict(
        **_deepseek_style_keys(reader, key), num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=int(q_lora_rank or 0) or None, kv_lora_rank=int(key("attention.kv_lora_rank")),
        qk_rope_head_dim=rope_dim, head_dim=rope_dim, qk_nope_head_dim=qk_head - rope_dim,
        v_head_dim=int(key("attention.value_length_mla" if mla else "attention.value_length")), rope_parameters=rope)


def glm_dsa_config(source: Path, reader) -> GlmMoeDsaConfig:
    """GLM-5 (and 5.1, 5.2) from llama.cpp's `glm-dsa` keys, which its converter writes as for DeepSeek-V3 (MLA in
    the absorbed form, the sigmoid router with its correction bias, a shared expert, dense layers first, the
    multi-token-prediction block last) with the sparse attention's indexer beside them: its heads, head size and
    top-k, and which layers run it (`_indexer_types`)."""
    key = arch_keys(reader, "glm-dsa")
    _check_keys(source, key, "glm-dsa", GLM_DSA_KEYS, "GLM-5's")
    if int(key("expert_gating_func", SIGMOID_GATING)) != SIGMOID_GATING:  # llama.cpp's default for the family
        raise CheckpointError(f"{source}: a GLM-DSA file whose router is not sigmoid (`glm-dsa.expert_gating_func` "
                              f"{key('expert_gating_func')}), which GLM-5's model cannot run")
    common = _mla_keys(reader, key)
    return GlmMoeDsaConfig(
        **common, index_n_heads=int(key("attention.indexer.head_count")),
        index_head_dim=int(key("attention.indexer.key_length")), index_topk=int(key("attention.indexer.top_k")),
        indexer_types=_indexer_types(source, key, common["num_hidden_layers"]))


def _check_keys(source: Path, key: Callable[..., Any], arch: str, names: tuple[str, ...], model: str) -> None:
    """Refuse a file without any of the keys `names` (`key`: its `arch_keys`), which `model` config is read from."""
    missing = [name for name in names if key(name) is None]
    if missing:
        raise CheckpointError(f"{source}: the {arch} file lacks the keys {', '.join(f'{arch}.{n}' for n in missing)}"
                              f", which {model} config is read from")


def _indexer_types(source: Path, key: Callable[..., Any], layers: int) -> list[str]:
    """Which layers run their own indexer (`full`) and which reuse the top-k of the last one that did (`shared`), as
    `attention.indexer.types` says (true: full); where a file names none, as llama.cpp reads it: every layer full
    (GLM-5, 5.1), or from a context of 2^20 on GLM-5.2's pattern (the first three full, then every fourth)."""
    types = key("attention.indexer.types")
    if types is None:
        glm_5_2 = int(key("context_length")) >= GLM_5_2_CONTEXT
        return ["full" if not glm_5_2 or i < 3 or (i - 2) % 4 == 0 else "shared" for i in range(layers)]
    full = [t in (True, "full") for t in (types if isinstance(types, list) else [types] * layers)]
    if len(full) != layers or not full[0]:  # a shared layer reuses an earlier full layer's choice
        raise CheckpointError(f"{source}: `glm-dsa.attention.indexer.types` names {len(full)} layers, the first "
                              f"{'full' if full[:1] == [True] else 'shared'}; the model has {layers}, the first full")
    return ["full" if f else "shared" for f in full]


def glm4moe_config(reader, tensor_names: set[str]) -> Glm4MoeConfig:
    """GLM-4.5, 4.6 and 4.7 from llama.cpp's `glm4moe` keys: DeepSeek-V3's router and shared expert with grouped-query
    attention, rotary on part of each head (NeoX order, as the model's own); q/k/v biases and q/k norms where the
    file holds them."""
    key = arch_keys(reader, "glm4moe")
    head_dim = int(key("attention.key_length"))
    return Glm4MoeConfig(
        **_deepseek_style_keys(reader, key), num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")), head_dim=head_dim,
        attention_bias="blk.0.attn_q.bias" in tensor_names, use_qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base")),
                         "partial_rotary_factor": int(key("rope.dimension_count")) / head_dim})


def gemma4_config(reader, tensor_names: set[str]) -> Gemma4TextConfig:
    """Gemma 4's text model (the MoE ones, e.g. 26B-A4B) from llama.cpp's `gemma4` keys: sliding and full attention
    layers, each kind with its own head size, KV heads and rotary base; full layers whose keys are their values
    where the file has no `attn_v` for them, and rotary on the part of their heads that `rope_freqs` leaves at 1
    (llama.cpp marks the rest with a huge factor)."""
    key = arch_keys(reader, "gemma4")
    layers = int(key("block_count"))
    sliding = [bool(x) for x in key("attention.sliding_window_pattern")]
    kv_heads = key("attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    full = [i for i in range(layers) if not sliding[i]]
    shared_kv = int(key("attention.shared_kv_layers", 0))
    head_dim, full_head_dim = int(key("attention.key_length_swa")), int(key("attention.key_length"))
    factors = next((t.data for t in reader.tensors if t.name == "rope_freqs.weight"), np.ones(full_head_dim // 2))
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa"))},
            "full_attention": {"rope_type": "proportional", "rope_theta": float(key("rope.freq_base")),
                               "partial_rotary_factor": 2 * int((factors < 1e3).sum()) / full_head_dim}}
    if (swa_rotary := int(key("rope.dimension_count_swa", head_dim))) != head_dim:
        rope["sliding_attention"]["partial_rotary_factor"] = swa_rotary / head_dim
    return Gemma4TextConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(kv_heads[sliding.index(True)] if any(sliding) else kv_heads[0]),
        num_global_key_value_heads=int(kv_heads[full[0]]) if full else None, head_dim=head_dim,
        global_head_dim=full_head_dim, layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        attention_k_eq_v=any(f"blk.{i}.attn_v.weight" not in tensor_names for i in full if i < layers - shared_kv),
        sliding_window=int(key("attention.sliding_window")), num_kv_shared_layers=shared_kv,
        hidden_size_per_layer_input=int(key("embedding_length_per_layer_input", 0)),
        final_logit_softcapping=key("final_logit_softcapping"), rope_parameters=rope,
        enable_moe_block=int(key("expert_count", 0)) > 0, num_experts=key("expert_count"),
        top_k_experts=key("expert_used_count"), moe_intermediate_size=key("expert_feed_forward_length"),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), max_position_embeddings=int(key("context_length")))


def dots1_config(reader) -> Dots1Config:
    """dots.llm1 from llama.cpp's `dots1` keys: DeepSeek-V3's router and shared experts with Qwen3's attention (q/k
    norms, grouped-query heads)."""
    key = arch_keys(reader, "dots1")
    return Dots1Config(
        **_deepseek_style_keys(reader, key), num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")), head_dim=int(key("attention.key_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base"))})


def afmoe_config(source: Path, reader) -> AfmoeConfig:
    """Arcee's Trinity models (Trinity-Mini 26B-A3B, -Nano 6B-A1B) from llama.cpp's `afmoe` keys: dense layers first,
    then a sigmoid router with its correction bias and shared experts beside it; attention with q/k norms and a
    sigmoid gate on its output, sliding with rotary on three layers of four, full without on the fourth; embeddings
    scaled by the square root of the width (muP), which llama.cpp does for every afmoe file."""
    key = arch_keys(reader, "afmoe", source)
    _check_vocabulary(source, reader)
    sizes = _sizes(key, reader)
    head_dim = int(key("attention.key_length", sizes["hidden_size"] // sizes["num_attention_heads"]))
    _check_afmoe_router(source, key)
    return AfmoeConfig(
        **sizes, head_dim=head_dim, intermediate_size=int(key("feed_forward_length")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        num_dense_layers=int(key("leading_dense_block_count", 0)), num_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")), num_shared_experts=int(key("expert_shared_count")),
        route_scale=float(key("expert_weights_scale", 0.0)) or 1.0,  # llama.cpp leaves 0 (or none) unscaled
        layer_types=_afmoe_layer_types(source, key, sizes["num_hidden_layers"]),
        global_attn_every_n_layers=AFMOE_PERIOD, sliding_window=int(key("attention.sliding_window")), mup_enabled=True,
        rope_parameters=_afmoe_rope(source, key, head_dim))


def _check_afmoe_router(source: Path, key: Callable[..., Any]) -> None:
    """transformers' AFMoE scores every expert by a sigmoid, in no groups, and renormalises the top-k weights: a file
    whose router llama.cpp would run otherwise is refused by the key that says so."""
    if (key("expert_gating_func", 0) or SIGMOID_GATING) != SIGMOID_GATING:  # none: llama.cpp's sigmoid
        raise CheckpointError(f"{source}: its router does not score by a sigmoid (`afmoe.expert_gating_func`), the "
                              f"only way transformers' AFMoE scores")
    if not key("expert_weights_norm", False):
        raise CheckpointError(f"{source}: its router's top-k weights are not renormalised (`afmoe.expert_weights_norm` "
                              f"false or absent), which transformers' AFMoE always does")
    if int(key("expert_group_count", 1)) > 1:
        raise CheckpointError(f"{source}: its router picks experts in groups (`afmoe.expert_group_count`), which "
                              f"transformers' AFMoE does not")


def _afmoe_rope(source: Path, key: Callable[..., Any], head_dim: int) -> dict[str, Any]:
    """Unscaled rotary over the whole head, which is all transformers' AFMoE has; only sliding layers rotate, so
    theirs is the base where the file gives one."""
    if key("rope.scaling.type", "none") != "none":
        raise CheckpointError(f"{source}: its rotary is scaled (`afmoe.rope.scaling.type` {key('rope.scaling.type')}"
                              f"), which moe-serve does not read for afmoe")
    if (rotated := int(key("rope.dimension_count", head_dim))) != head_dim:
        raise CheckpointError(f"{source}: its rotary turns {rotated} of each head's {head_dim} dimensions "
                              f"(`afmoe.rope.dimension_count`); transformers' AFMoE turns them all")
    return {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", key("rope.freq_base", 10000.0)))}


def _afmoe_layer_types(source: Path, key: Callable[..., Any], layers: int) -> list[str]:
    """Sliding layers but every fourth, full, as llama.cpp runs a file with a window and no other period."""
    if not key("attention.sliding_window", 0):
        raise CheckpointError(f"{source}: an afmoe file without a sliding window (`afmoe.attention.sliding_window`): "
                              f"llama.cpp then attends in full on the layers it rotates, which transformers' AFMoE "
                              f"cannot describe")
    if (period := key("attention.sliding_window_pattern", AFMOE_PERIOD)) != AFMOE_PERIOD:
        raise CheckpointError(f"{source}: its full attention layers come every {period} (`afmoe.attention"
                              f".sliding_window_pattern`), its unrotated ones every {AFMOE_PERIOD}; transformers' "
                              f"AFMoE has them the same")
    return ["full_attention" if (i + 1) % AFMOE_PERIOD == 0 else "sliding_attention" for i in range(layers)]


def _check_vocabulary(source: Path, reader) -> None:
    """Refuse a file without the vocabulary that the model's size is read from."""
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise CheckpointError(f"{source}: the GGUF file has no vocabulary (`tokenizer.ggml.tokens`)")


def mimo2_config(source: Path, reader, tensor_names: set[str]) -> MiMoV2FlashConfig:
    """Xiaomi's MiMo-V2-Flash (309B-A15B) from llama.cpp's `mimo2` keys: sliding and full attention layers as
    `attention.sliding_window_pattern` says, a sliding layer with twice a full one's KV heads and attention sinks;
    query/key heads wider than value heads, values scaled by `attention.value_scale`; rotary on part of each head at
    one base per kind of layer; a dense layer where the file holds no router, elsewhere a sigmoid router with its
    correction bias and no shared expert; a trailing multi-token-prediction block left out."""
    key = arch_keys(reader, "mimo2", source)
    _check_vocabulary(source, reader)
    sizes = _sizes(key, reader)
    layers = sizes["num_hidden_layers"] - int(key("nextn_predict_layers", 0))  # MTP blocks come last
    sliding = [bool(s) for s in per_layer(key("attention.sliding_window_pattern"), layers, source)]
    head_dim = int(key("attention.key_length", sizes["hidden_size"] // sizes["num_attention_heads"]))
    _check_mimo2_router(source, key)
    _check_mimo2_attention(source, tensor_names, sliding)
    return MiMoV2FlashConfig(
        **sizes | {"num_hidden_layers": layers, "num_key_value_heads": _mimo2_kv_heads(source, key, sliding)},
        head_dim=head_dim, v_head_dim=int(key("attention.value_length", head_dim)),
        intermediate_size=int(key("feed_forward_length")),
        moe_intermediate_size=int(key("expert_feed_forward_length")), n_routed_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")), n_group=int(key("expert_group_count", 0) or 1),
        topk_group=int(key("expert_group_used_count", 0) or 1), norm_topk_prob=True, routed_scaling_factor=1.0,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        mlp_layer_types=["sparse" if f"blk.{i}.ffn_gate_inp.weight" in tensor_names else "dense"
                         for i in range(layers)],
        sliding_window=int(key("attention.sliding_window")), attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_value_scale=_mimo2_value_scale(source, key),
        rope_parameters=_mimo2_rope(source, key, head_dim))


def _mimo2_value_scale(source: Path, key: Callable[..., Any]) -> float | None:
    """The file's `attention.value_scale` (None, unscaled, for 0 or 1, as llama.cpp reads it); where it has none,
    MiMo-V2-Flash's own, the model llama.cpp's converter wrote such files from, which llama.cpp runs unscaled."""
    scale = key("attention.value_scale", None)
    if scale is None:
        log.warning("GGUF %s: no `mimo2.attention.value_scale`, as llama.cpp wrote MiMo-V2-Flash before May 2026: its "
                    "values are scaled by MiMo-V2-Flash's %s, as transformers runs the model (llama.cpp runs such a "
                    "file unscaled)", source, MIMO_V2_FLASH_VALUE_SCALE)
        return MIMO_V2_FLASH_VALUE_SCALE
    return None if float(scale) in (0.0, 1.0) else float(scale)


def _mimo2_kv_heads(source: Path, key: Callable[..., Any], sliding: list[bool]) -> int:
    """The KV heads of a full attention layer, where every sliding layer has twice as many, the only pattern
    transformers' MiMo-V2-Flash can describe; another is refused."""
    kv_heads = [int(n) for n in per_layer(key("attention.head_count_kv", key("attention.head_count")),
                                          len(sliding), source)]
    full = {n for n, s in zip(kv_heads, sliding) if not s}
    window = {n for n, s in zip(kv_heads, sliding) if s}
    heads = min(full) if full else min(window) // 2
    if len(full) > 1 or window - {2 * heads}:
        raise CheckpointError(f"{source}: its KV heads per layer (`mimo2.attention.head_count_kv` {kv_heads}) are not "
                              f"one count in full attention layers and twice it in sliding ones, which is all "
                              f"transformers' MiMo-V2-Flash can describe")
    return heads


def _check_mimo2_router(source: Path, key: Callable[..., Any]) -> None:
    """Refuse, by the key, a file whose router keys say other than llama.cpp's mimo2 runs regardless of them
    (`MIMO2_ROUTER`): it was written from a model that neither llama.cpp nor transformers' MiMo-V2-Flash runs."""
    for name, runs in MIMO2_ROUTER.items():
        if (value := key(name, runs[0])) not in runs:
            raise CheckpointError(f"{source}: `mimo2.{name}` is {value}, which llama.cpp's mimo2 ignores: it routes "
                                  f"by a sigmoid, renormalised and unscaled, as transformers' MiMo-V2-Flash does")


def _check_mimo2_attention(source: Path, tensor_names: set[str], sliding: list[bool]) -> None:
    """What transformers' MiMo-V2-Flash cannot hold: sinks in a full attention layer (it has them in its sliding
    layers only), q, k and v fused in one tensor (MiMo-V2.5's `attn_qkv`, which moe-serve does not split)."""
    for i, slides in enumerate(sliding):
        if not slides and f"blk.{i}.attn_sinks.weight" in tensor_names:
            raise CheckpointError(f"{source}: its full attention layer {i} has attention sinks (`blk.{i}.attn_sinks`), "
                                  f"which transformers' MiMo-V2-Flash has in sliding layers only")
        if f"blk.{i}.attn_qkv.weight" in tensor_names:
            raise CheckpointError(f"{source}: layer {i} has q, k and v fused (`blk.{i}.attn_qkv`, MiMo-V2.5's layout), "
                                  f"which moe-serve does not split for mimo2")


def _mimo2_rope(source: Path, key: Callable[..., Any], head_dim: int) -> dict[str, Any]:
    """Unscaled rotary on the first `rope.dimension_count` dimensions of each head, at `rope.freq_base` in full
    attention layers and `rope.freq_base_swa` in sliding ones (llama.cpp: the same where the file has none)."""
    if key("rope.scaling.type", "none") != "none" or float(key("rope.scaling.factor", 1.0)) not in (0.0, 1.0):
        raise CheckpointError(f"{source}: its rotary is scaled (`mimo2.rope.scaling.*`), which moe-serve does not "
                              f"read for mimo2")
    rotated = int(key("rope.dimension_count", head_dim))
    if rotated % 2 or rotated > head_dim:
        raise CheckpointError(f"{source}: its rotary turns {rotated} of each head's {head_dim} dimensions "
                              f"(`mimo2.rope.dimension_count`), which transformers' MiMo-V2-Flash cannot")
    base, share = float(key("rope.freq_base", 10000.0)), rotated_share(rotated, head_dim)
    bases = {"full_attention": base, "sliding_attention": float(key("rope.freq_base_swa", base))}
    return {kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": share}
            for kind, theta in bases.items()}


def rotated_share(rotated: int, head_dim: int) -> float:
    """The `partial_rotary_factor` of which transformers rotates `int(head_dim * factor)` = `rotated` dimensions:
    `rotated / head_dim`, one float step up where that product falls short (e.g. 30 of 88)."""
    share = rotated / head_dim
    return share if int(head_dim * share) == rotated else float(np.nextafter(share, 1.0))


def step35_config(source: Path, reader, tensor_names: set[str]) -> Step3p7TextConfig:
    """StepFun's Step-3.5-Flash (196B-A11B) from llama.cpp's `step35` keys, read as transformers' Step 3.7
    language model (`step3p5`): sliding and full attention layers as `attention.sliding_window_pattern` says,
    each kind with its own head count (`attention.head_count`, per layer) and rotary base, a full layer
    rotating half of what a sliding one does (llama.cpp halves `rope.dimension_count` there); a per-head
    sigmoid gate on attention's output; a dense layer where the file holds no router, elsewhere a sigmoid
    router with its correction bias beside a shared expert, SwiGLU clamped per layer where
    `swiglu_clamp_exp`/`_shexp` say; trailing multi-token-prediction layers left out."""
    key = arch_keys(reader, "step35", source)
    _check_vocabulary(source, reader)
    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))  # MTP layers come last
    sliding = [bool(s) for s in per_layer(key("attention.sliding_window_pattern"), layers, source)]
    full_heads, sliding_heads, kv_heads = _step35_heads(source, key, sliding)
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // (sliding_heads if sliding[0] else full_heads)))
    _check_step35_head_sizes(source, key, head_dim)

    def limits(name: str) -> list[float]:
        return [float(v) for v in per_layer(key(name, 0.0), layers, source)]  # 0: not clamped

    return Step3p7TextConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=full_heads, num_sliding_attention_heads=sliding_heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=int(key("feed_forward_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")), n_routed_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        share_expert_dim=int(key("expert_shared_feed_forward_length")),
        moe_router_scaling_factor=_step35_router_scale(source, key),
        sliding_window=int(key("attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        mlp_layer_types=["sparse" if f"blk.{i}.ffn_gate_inp.weight" in tensor_names else "dense"
                         for i in range(layers)],
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        swiglu_limits=limits("swiglu_clamp_exp"), swiglu_limits_shared=limits("swiglu_clamp_shexp"),
        rope_parameters=_step35_rope(source, key, head_dim, tensor_names),
        bos_token_id=None, eos_token_id=None, **_step35_pad(reader))  # the file's vocabulary's, not Step's


def _step35_pad(reader) -> dict[str, int]:
    """The file's padding id, where it names one (Step's config holds an int: its own default otherwise)."""
    field = reader.fields.get("tokenizer.ggml.padding_token_id")
    return {} if field is None else {"pad_token_id": int(field.contents())}


def _step35_heads(source: Path, key: Callable[..., Any], sliding: list[bool]) -> tuple[int, int, int]:
    """Heads of a full and of a sliding attention layer, and the KV heads of every layer: one count per kind
    of layer and one KV count in all, all that transformers' Step 3.7 can describe; another is refused."""
    layers = len(sliding)
    heads = [int(n) for n in per_layer(key("attention.head_count"), layers, source)]
    kv_heads = [int(n) for n in per_layer(key("attention.head_count_kv", key("attention.head_count")),
                                          layers, source)]
    full = {n for n, s in zip(heads, sliding) if not s}
    window = {n for n, s in zip(heads, sliding) if s}
    if len(full) > 1 or len(window) > 1:
        raise CheckpointError(f"{source}: its heads per layer (`step35.attention.head_count` {heads}) are "
                              f"not one count in full attention layers and one in sliding ones, which is all "
                              f"transformers' Step 3.7 can describe")
    if len(set(kv_heads)) > 1:
        raise CheckpointError(f"{source}: its KV heads per layer (`step35.attention.head_count_kv` "
                              f"{kv_heads}) differ between layers; transformers' Step 3.7 has one count")
    return min(full or window), min(window or full), kv_heads[0]


def _check_step35_head_sizes(source: Path, key: Callable[..., Any], head_dim: int) -> None:
    """Refuse value heads, or a sliding layer's heads, of another size than the query/key heads
    (`head_dim`): transformers' Step 3.7 has one head size."""
    for name in ("attention.value_length", "attention.key_length_swa", "attention.value_length_swa"):
        if (size := key(name, head_dim)) != head_dim:
            raise CheckpointError(f"{source}: `step35.{name}` is {size}, its heads {head_dim} wide "
                                  f"elsewhere; transformers' Step 3.7 has one head size")


def _step35_router_scale(source: Path, key: Callable[..., Any]) -> float:
    """The routed experts' scale (`expert_weights_scale`, none where 0 or absent, as llama.cpp reads it); a
    router llama.cpp would run otherwise than transformers' Step 3.7 (a sigmoid over the experts, the top-k
    weights renormalised) is refused by the key that says so."""
    if (gating := key("expert_gating_func", 0)) not in (0, SIGMOID_GATING):  # 0: llama.cpp's default
        raise CheckpointError(f"{source}: its router does not score by a sigmoid "
                              f"(`step35.expert_gating_func` {gating}), the only way transformers' Step 3.7 "
                              f"scores")
    if not key("expert_weights_norm", False):
        raise CheckpointError(f"{source}: its router's top-k weights are not renormalised "
                              f"(`step35.expert_weights_norm` false or absent: llama.cpp then runs them as "
                              f"they are), which transformers' Step 3.7 always does")
    scale = float(key("expert_weights_scale", 0.0))
    return scale if scale else 1.0


def _step35_rope(source: Path, key: Callable[..., Any], head_dim: int,
                 tensor_names: set[str]) -> dict[str, Any]:
    """Unscaled rotary at `rope.freq_base` in full attention layers over half of `rope.dimension_count`
    (each head's width where absent), at `rope.freq_base_swa` in sliding ones over
    `rope.dimension_count_swa` (llama.cpp: the full count and base where the file has none)."""
    factor = float(key("rope.scaling.factor", 1.0))  # 0: none, as llama.cpp reads it
    scaled = key("rope.scaling.type", "none") != "none" or factor not in (0.0, 1.0)
    if scaled or "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"{source}: its rotary is scaled (`rope_freqs` or `step35.rope.scaling.*`), "
                              f"which moe-serve does not read for step35")
    rotated = int(key("rope.dimension_count", head_dim))
    turned = {"full_attention": rotated // 2,
              "sliding_attention": int(key("rope.dimension_count_swa", rotated))}
    for kind, n in turned.items():
        if n % 2 or not 0 < n <= head_dim:
            raise CheckpointError(f"{source}: its {kind} layers would turn {n} of each head's {head_dim} "
                                  f"dimensions (`step35.rope.dimension_count` {rotated}, halved in full "
                                  f"attention layers), which transformers' Step 3.7 cannot")
    base = float(key("rope.freq_base", 10000.0))
    bases = {"full_attention": base, "sliding_attention": float(key("rope.freq_base_swa", base))}
    return {kind: {"rope_type": "default", "rope_theta": bases[kind],
                   "partial_rotary_factor": rotated_share(turned[kind], head_dim)} for kind in turned}


class Step35Names:
    """GGUF tensor → the parameter of Step 3.7's language model (`model.language_model...`) by llama.cpp's
    `step35` names. Its norms are stored plus one (llama.cpp multiplies by w, the model by 1 + w): given
    back less one. Layers past the model's (multi-token prediction) map to nothing and are not read."""

    LAYER = re.compile(r"blk\.(?P<layer>\d+)\.(?P<leaf>.+)")
    WHOLE = {"token_embd.weight": "model.language_model.embed_tokens.weight",
             "output_norm.weight": "model.language_model.norm.weight", "output.weight": "lm_head.weight"}
    LEAVES = {"attn_norm.weight": "input_layernorm.weight",
              "ffn_norm.weight": "post_attention_layernorm.weight",
              **{f"attn_{ours}.{kind}": f"self_attn.{theirs}_proj.{kind}" for kind in ("weight", "bias")
                 for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))},
              "attn_q_norm.weight": "self_attn.q_norm.weight",
              "attn_k_norm.weight": "self_attn.k_norm.weight",
              "attn_gate.weight": "self_attn.g_proj.weight",  # [heads, H]: one gate per head
              **{f"ffn_{w}.weight": f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")},
              **{f"ffn_{w}_shexp.weight": f"mlp.shared_experts.{w}_proj.weight"
                 for w in ("gate", "up", "down")},
              "ffn_gate_inp.weight": "mlp.gate.weight",
              "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
              "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
              "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
              "ffn_down_exps.weight": "mlp.experts.down_proj"}

    def target(self, name: str) -> str | None:
        if name in self.WHOLE:
            return self.WHOLE[name]
        m = self.LAYER.fullmatch(name)
        leaf = self.LEAVES.get(m["leaf"]) if m else None
        return leaf and f"model.language_model.layers.{m['layer']}.{leaf}"

    def convert(self, name: str, weights: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(weights)
        return tensor - 1.0 if name.endswith("norm.weight") else tensor

    def check_expert(self, name: str) -> None:
        """Experts are read from the file as they lie: llama.cpp's converter changes none."""


def ernie4_5_moe_config(reader, tensor_names: set[str]) -> Ernie4_5_MoeConfig:
    """ERNIE 4.5's MoE models (e.g. 21B-A3B, 300B-A47B) from llama.cpp's `ernie4_5-moe` keys: dense layers first,
    then an MoE layer every `interleave_moe_layer_step`, to the last; shared experts of the routed ones' size."""
    key = arch_keys(reader, "ernie4_5-moe")
    layers, heads, hidden = int(key("block_count")), int(key("attention.head_count")), int(key("embedding_length"))
    return Ernie4_5_MoeConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv")),
        head_dim=int(key("attention.key_length", hidden // heads)),
        use_bias="blk.0.attn_q.bias" in tensor_names,
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 500000.0))},
        moe_num_experts=int(key("expert_count")), moe_k=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        moe_num_shared_experts=int(key("expert_shared_count", 0)),
        moe_layer_start_index=int(key("leading_dense_block_count", 0)), moe_layer_end_index=layers - 1,
        moe_layer_interval=int(key("interleave_moe_layer_step", 1)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), max_position_embeddings=int(key("context_length")))


def llama4_config(source: Path, reader) -> Llama4TextConfig:
    """Llama 4 (Scout, Maverick) from llama.cpp's `llama4` keys: an MoE layer every `interleave_moe_layer_step`, dense
    layers of `feed_forward_length` between; what llama.cpp fixes for the family rather than reading it (no rotary on
    every fourth layer, attention in chunks of 8192 on the others, the attention temperature of the unrotated layers,
    and the weightless q/k norm, which the 128-expert Maverick lacks) left at transformers' defaults, which are the
    same; Llama 3's rotary scaling rebuilt from the factors the file keeps in `rope_freqs`. Ollama's own files (`ollama
    pull llama4`) have the same tensors but name the widths `intermediate_size` (dense) and `intermediate_size_moe`
    (its `feed_forward_length` is the experts') and say whether q/k are normed."""
    key = arch_keys(reader, "llama4")
    ollama = key("intermediate_size_moe") is not None
    heads, hidden, layers = int(key("attention.head_count")), int(key("embedding_length")), int(key("block_count"))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // heads)))
    experts = int(key("expert_count", 0))
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 500000.0))}
    factors = next((t.data for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if factors is not None:
        original = int(key("rope.scaling.original_context_length", LLAMA3_ORIGINAL_CONTEXT))
        rope = llama3_rope(source, rope["rope_theta"], head_dim, np.asarray(factors, np.float64), original)
    step = int(key("interleave_moe_layer_step", 1))
    return Llama4TextConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=hidden,
        intermediate_size=int(key("intermediate_size_moe") if ollama else key("expert_feed_forward_length", 0)),
        intermediate_size_mlp=int(key("intermediate_size") if ollama else key("feed_forward_length")),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=int(key("attention.head_count_kv")),
        head_dim=head_dim, num_local_experts=experts, num_experts_per_tok=int(key("expert_used_count", 1)),
        interleave_moe_layer_step=step, moe_layers=None if experts else [],
        use_qk_norm=bool(key("use_qk_norm", experts != 128)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), max_position_embeddings=int(key("context_length")),
        rope_parameters=rope)


def _sizes(key: Callable[..., Any], reader) -> dict[str, Any]:
    """The sizes every llama.cpp file gives under the same keys: vocabulary, width, layers, heads (KV heads per layer
    in hybrid files, 0 where a layer has no attention: the config takes the largest), norm epsilon, context."""
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    return dict(vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=int(key("embedding_length")),
                num_hidden_layers=int(key("block_count")), num_attention_heads=heads,
                num_key_value_heads=int(max(kv_heads) if isinstance(kv_heads, list) else kv_heads),
                rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
                max_position_embeddings=int(key("context_length")))


def expert_width(reader) -> int:
    """The experts' hidden width, from their down projections (`[E, H, I]`; GGUF shapes list columns first)."""
    down = next((t for t in reader.tensors if EXPERT_TENSOR.fullmatch(t.name) and ".ffn_down" in t.name), None)
    if down is None:
        raise CheckpointError("the GGUF file says neither its experts' width (`expert_feed_forward_length`) nor holds "
                              "their down projections in its first part, where that width is read from")
    return int(down.shape[0])


def qwen3vlmoe_config(reader) -> Qwen3MoeConfig:
    """Qwen3-VL's MoE models (Qwen3-VL-30B-A3B, -235B-A22B) from llama.cpp's and Ollama's `qwen3vlmoe` keys, read as
    their text model, a Qwen3 MoE: their rotary turns each frequency by one of three position axes, which for text
    all hold the token's position, so it is Qwen3's plain rotary. The router always renormalises its top-k weights
    (Ollama's `norm_top_k_prob` copies a setting Qwen3-VL's config lacks); Ollama's files give the experts' width
    only by their shape; the vision model (in Ollama's file, beside it in llama.cpp's) is left aside."""
    key = arch_keys(reader, "qwen3vlmoe")
    sizes = _sizes(key, reader)
    return Qwen3MoeConfig(
        **sizes, head_dim=int(key("attention.key_length", sizes["hidden_size"] // sizes["num_attention_heads"])),
        intermediate_size=int(key("feed_forward_length")),
        moe_intermediate_size=int(key("expert_feed_forward_length") or expert_width(reader)),
        num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")), norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base"))})


def olmoe_config(reader) -> OlmoeConfig:
    """OLMoE from llama.cpp's `olmoe` keys: every layer MoE, experts of `feed_forward_length`, q/k normed over the
    whole projection, the router's top-k weights not renormalised (as llama.cpp runs it and OLMoE was trained)."""
    key = arch_keys(reader, "olmoe")
    return OlmoeConfig(
        **_sizes(key, reader), intermediate_size=int(key("expert_feed_forward_length", key("feed_forward_length"))),
        num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))})


def granitemoe_config(reader) -> GraniteMoeConfig | GraniteMoeSharedConfig:
    """Granite 3's MoE models (e.g. granite-3.1-3b-a800m), with a shared expert where the file gives its width
    (`granitemoeshared`), from llama.cpp's `granitemoe` keys."""
    common = _granite_keys(arch_keys(reader, "granitemoe"), reader)
    if "shared_intermediate_size" in common:
        return GraniteMoeSharedConfig(**common)
    return GraniteMoeConfig(**common)


def granitehybrid_config(reader, tensor_names: set[str]) -> GraniteMoeHybridConfig:
    """Granite 4's hybrid MoE models (e.g. granite-4.0-h-tiny, -h-small) from llama.cpp's `granitehybrid` keys: Mamba-2
    layers where the file gives no KV heads, attention layers elsewhere, rotary only where the file says the model was
    trained with it (Granite 4 has none); the Mamba-2 sizes in llama.cpp's SSM keys."""
    key = arch_keys(reader, "granitehybrid")
    common = _granite_keys(key, reader)
    kv_heads = key("attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * common["num_hidden_layers"]
    inner, ssm_heads = int(key("ssm.inner_size")), int(key("ssm.time_step_rank"))
    first_mamba = next((i for i, n in enumerate(kv_heads) if not n), 0)
    return GraniteMoeHybridConfig(
        **common,
        layer_types=["full_attention" if n else "linear_attention" for n in kv_heads],
        position_embedding_type="rope" if key("rope.scaling.finetuned", False) else "nope",
        mamba_n_heads=ssm_heads, mamba_n_groups=int(key("ssm.group_count")), mamba_d_state=int(key("ssm.state_size")),
        mamba_d_head=inner // ssm_heads, mamba_d_conv=int(key("ssm.conv_kernel")),
        mamba_expand=inner // common["hidden_size"],
        mamba_conv_bias=f"blk.{first_mamba}.ssm_conv1d.bias" in tensor_names,
        mamba_proj_bias=f"blk.{first_mamba}.ssm_in.bias" in tensor_names)


def _granite_keys(key: Callable[..., Any], reader) -> dict[str, Any]:
    """The settings Granite's MoE models share, from llama.cpp's keys: its four multipliers are llama.cpp's embedding,
    residual, attention and logit scales; a shared expert where the file gives its width."""
    common = dict(
        **_sizes(key, reader), intermediate_size=int(key("expert_feed_forward_length", key("feed_forward_length"))),
        num_local_experts=int(key("expert_count", 0)), num_experts_per_tok=int(key("expert_used_count", 0)),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
        embedding_multiplier=float(key("embedding_scale", 1.0)), residual_multiplier=float(key("residual_scale", 1.0)),
        attention_multiplier=float(key("attention.scale", 1.0)), logits_scaling=float(key("logit_scale", 1.0)))
    if shared := key("expert_shared_feed_forward_length"):
        common["shared_intermediate_size"] = int(shared)
    return common


def lfm2moe_config(reader, tensor_names: set[str]) -> Lfm2MoeConfig:
    """LFM2's MoE models (e.g. LFM2-8B-A1B) from llama.cpp's `lfm2moe` keys: short-convolution layers where the file
    gives no KV heads, attention layers elsewhere; dense layers first; a sigmoid router with its expert bias."""
    key = arch_keys(reader, "lfm2moe")
    kv_heads = key("attention.head_count_kv")
    layers = int(key("block_count"))
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    dense = int(key("leading_dense_block_count", 0))
    return Lfm2MoeConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")), moe_intermediate_size=int(key("expert_feed_forward_length")),
        num_hidden_layers=layers, num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(max(kv_heads)), layer_types=["full_attention" if n else "conv" for n in kv_heads],
        num_dense_layers=dense, num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        norm_topk_prob=bool(key("expert_weights_norm", True)),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
        use_expert_bias=f"blk.{dense}.exp_probs_b.bias" in tensor_names, conv_L_cache=int(key("shortconv.l_cache")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")), max_position_embeddings=int(key("context_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1000000.0))})


def hunyuan_moe_config(reader) -> HunYuanMoEV1Config:
    """Hunyuan-A13B from llama.cpp's `hunyuan-moe` keys: its NTK-alpha rotary is written as the base it scales to
    (`rope.freq_base`), which transformers' rotary then takes as it is; experts and the shared expert one width."""
    key = arch_keys(reader, "hunyuan-moe")
    sizes = _sizes(key, reader)
    return HunYuanMoEV1Config(
        **sizes, intermediate_size=int(key("expert_feed_forward_length", key("feed_forward_length"))),
        head_dim=int(key("attention.key_length", sizes["hidden_size"] // sizes["num_attention_heads"])),
        num_experts=int(key("expert_count")), moe_topk=int(key("expert_used_count")),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base"))})


def jamba_config(source: Path, reader, tensor_names: set[str]) -> JambaConfig:
    """Jamba (e.g. AI21-Jamba-Mini-1.7) from llama.cpp's `jamba` keys: attention layers where the file gives KV heads,
    Mamba layers elsewhere; MoE layers where it holds a router. Jamba repeats both every so many layers, which is all
    its config can say: another pattern is refused."""
    key = arch_keys(reader, "jamba")
    layers, hidden = int(key("block_count")), int(key("embedding_length"))
    kv_heads = key("attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    attention = [i for i, n in enumerate(kv_heads) if n]
    moe = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names]
    attn_offset, attn_period = _every(source, "attention", attention, layers)
    expert_offset, expert_period = _every(source, "MoE", moe, layers)
    first_mamba = next((i for i, n in enumerate(kv_heads) if not n), 0)
    return JambaConfig(
        **_sizes(key, reader), intermediate_size=int(key("feed_forward_length")),
        num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        attn_layer_offset=attn_offset, attn_layer_period=attn_period, expert_layer_offset=expert_offset,
        expert_layer_period=expert_period, mamba_d_state=int(key("ssm.state_size")),
        mamba_d_conv=int(key("ssm.conv_kernel")), mamba_expand=int(key("ssm.inner_size")) // hidden,
        mamba_dt_rank=int(key("ssm.time_step_rank")),
        mamba_conv_bias=f"blk.{first_mamba}.ssm_conv1d.bias" in tensor_names,
        mamba_proj_bias=f"blk.{first_mamba}.ssm_in.bias" in tensor_names)


def _every(source: Path, kind: str, indices: list[int], layers: int) -> tuple[int, int]:
    """The (offset, period) that gives the layer `indices`; a CheckpointError where none does."""
    if not indices:
        raise CheckpointError(f"{source}: a Jamba file with no {kind} layer, which its config cannot describe")
    offset = indices[0]
    period = indices[1] - offset if len(indices) > 1 else layers
    if indices != list(range(offset, layers, period)):
        raise CheckpointError(f"{source}: its {kind} layers {indices} do not repeat at one period, which is all "
                              f"Jamba's config can describe")
    return offset, period


def llama3_rope(source: Path, theta: float, head_dim: int, factors: np.ndarray, original: int) -> dict[str, Any]:
    """Llama 3's rotary scaling (`rope_type: llama3`) from the per-frequency factors llama.cpp's converter computed
    from it: 1 for fast rotations, `factor` for slow ones, a smooth blend between. Only the ratios of the context
    length to the two frequency factors shape the factors, so the context length is taken as the file's (or llama.cpp's
    default) and the two factors fitted to it; the result is checked to give back every factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inverse = theta ** -(np.arange(0, head_dim, 2) / head_dim)
    if factors.shape != inverse.shape:
        raise CheckpointError(f"{source}: `rope_freqs` holds {factors.size} factors, the model's heads rotate "
                              f"{inverse.size} pairs")
    x = original * inverse / (2 * np.pi)  # the context over each wavelength: falls along the head
    factor = float(factors.max())
    if np.isclose(factor, 1.0):
        return {"rope_type": "default", "rope_theta": theta}
    ones, full = np.isclose(factors, 1.0, rtol=1e-5), np.isclose(factors, factor, rtol=1e-5)
    blend = ~ones & ~full
    share = (1 / factors[blend] - 1 / factor) / (1 - 1 / factor)  # how far each blended one is from `factor`
    if blend.sum() >= 2:  # share = (x - low) / (high - low)
        slope, intercept = np.polyfit(x[blend], share, 1)
        low = -intercept / slope
        high = low + 1 / slope
    else:
        above = x[ones].min() if ones.any() else 2 * x.max()  # x beyond `high` rotates unscaled
        below = x[full].max() if full.any() else x.min() / 2  # x below `low` is scaled by `factor`
        if blend.any():  # one blended frequency: `low` midway to the scaled ones and `high` from its share, or
            middle, part = float(x[blend][0]), float(share[0])  # the other way round where that one overshoots
            low = float(np.sqrt(middle * below))
            high = low + (middle - low) / part
            if high >= above:
                high = float(np.sqrt(middle * above))
                low = (middle - part * high) / (1 - part)
        else:  # a step: both between the scaled and the unscaled, no frequency between them
            low, high = float(below ** (2 / 3) * above ** (1 / 3)), float(below ** (1 / 3) * above ** (2 / 3))
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": float(low),
            "high_freq_factor": float(high), "original_max_position_embeddings": original}
    check = Llama4TextConfig(head_dim=head_dim, rope_parameters=rope)
    rebuilt, _ = ROPE_INIT_FUNCTIONS["llama3"](check)
    if not np.allclose(rebuilt.double().numpy(), inverse / factors, rtol=1e-4):
        raise CheckpointError(f"{source}: its rotary factors (`rope_freqs`) are not Llama 3's scaling, which is the "
                              f"only one moe-serve reads from them")
    return rope


def _deepseek_style_keys(reader, key: Callable[..., Any]) -> dict[str, Any]:
    """The sizes and router settings that llama.cpp writes alike for DeepSeek's MoE and the models built on it
    (`key`: the file's `arch_keys`), as DeepSeek-style configs name them."""
    return dict(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        num_hidden_layers=int(key("block_count")) - int(key("nextn_predict_layers", 0)),  # MTP blocks come last
        n_routed_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        n_shared_experts=int(key("expert_shared_count", 0)),
        first_k_dense_replace=int(key("leading_dense_block_count", 0)),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        n_group=int(key("expert_group_count", 1)), topk_group=int(key("expert_group_used_count", 1)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), max_position_embeddings=int(key("context_length")))


def gguf_expert_dtype(folder: Path) -> str | None:
    """The expert form (`--expert-dtype`) nearest to how the GGUF file that `folder` was converted from stored
    its experts: `mxfp4` where all are MXFP4 (kept as they are), `int4` where gate, up and down have at most 4
    bits, `int4-mixed` where only down has more (as in llama.cpp's Q4_K_M), `int8` where gate or up have more;
    None for float experts or another folder."""
    types = read_marker(folder).get("expert_types")
    if types is None:
        return None
    if types and all(names == ["MXFP4"] for names in types.values()):
        return "mxfp4"
    bits = {weight: max((GGUF_BITS.get(name, 16) for name in names), default=16) for weight, names in types.items()}
    gate_up = max((bits[weight] for weight in ("gate", "up", "gate_up") if weight in bits), default=16)
    if gate_up > 8 or not types:
        return None
    if gate_up > 4:
        return "int8"
    return "int4" if bits.get("down", 16) <= 4 else "int4-mixed"


def _expert_types(tensors) -> dict[str, list[str]]:
    """The GGUF types of the expert tensors, by weight (`gate`, `up`, `down`; `gate_up` fused)."""
    types: dict[str, set[str]] = {}
    for tensor in tensors:
        if (m := EXPERT_TENSOR.fullmatch(tensor.name)) and m["kind"] == "weight":
            types.setdefault(m["weight"], set()).add(tensor.tensor_type.name)
    return {weight: sorted(names) for weight, names in types.items()}


def storage_dtype(tensor) -> torch.dtype:
    """The dtype a GGUF tensor is written in (see `convert_gguf`)."""
    if len(tensor.shape) == 1:
        return torch.float32
    return {"F32": torch.float32, "BF16": torch.bfloat16}.get(tensor.tensor_type.name, torch.float16)


def mixtral_config(llama: PretrainedConfig, reader) -> MixtralConfig:
    """llama.cpp stores Mixtral as a llama with experts; transformers reads it as a dense llama."""
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings")
    return MixtralConfig(**{key: getattr(llama, key) for key in same if getattr(llama, key, None) is not None},
                         num_local_experts=int(reader.fields["llama.expert_count"].contents()),
                         num_experts_per_tok=int(reader.fields["llama.expert_used_count"].contents()))


class MixtralTensorProcessor(Qwen2MoeTensorProcessor):
    """Mixtral as llama.cpp writes it: llama's permuted q/k rows, experts merged per layer as Qwen-MoE's are."""

    def process(self, weights, name: str, **kwargs):
        if ".attn_q." in name or ".attn_k." in name:
            return LlamaTensorProcessor(self.config).process(weights, name, **kwargs)
        return super().process(weights, name, **kwargs)


class ShardWriter:
    """Tensors gathered into safetensors shards of about `SHARD_BYTES`, with the index transformers reads."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = self.bytes_written = 0
        self.written: dict[str, str] = {}  # parameter → shard file

    def add(self, name: str, tensor: torch.Tensor, expected: dict[str, tuple]) -> None:
        if name in expected and tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"GGUF tensor for {name} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {expected[name]}")
        tensor = tensor.contiguous()
        self.pending[name] = tensor
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        shard = f"model-{len(set(self.written.values())) + 1:05d}.safetensors"
        save_file(self.pending, self.folder / shard, metadata={"format": "pt"})
        self.written.update(dict.fromkeys(self.pending, shard))
        self.bytes_written += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self.flush()
        index = {"metadata": {"total_size": self.bytes_written}, "weight_map": self.written}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _check_complete(source: Path, found: set[str], expected: dict[str, tuple], config: PretrainedConfig) -> None:
    """Refuse a file that lacks a tensor for any of the model's parameters (`found`: those it has)."""
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - found - tied)
    if missing:
        raise CheckpointError(f"{source}: the GGUF file has no tensor for {len(missing)} parameters of "
                              f"{config.model_type} ({', '.join(missing[:4])}); serve the model's Hugging Face "
                              f"checkpoint instead")


def _save_companions(source: Path, reader, arch: str, config: PretrainedConfig, out: Path) -> None:
    """Config, tokenizer (with the file's chat template) and generation config, which stops at every id that
    ends a turn as llama.cpp reads the file: end of sequence, of turn, of message."""
    if arch == gguf_ollama.ARCH:  # transformers cannot read the file: its vocabulary alone, in a file of its own
        vocabulary = gguf_ollama.tokenizer_file(reader, out / "ollama-vocabulary.gguf")
        tokenizer = load_gguf_tokenizer(vocabulary, reads_config=False)
        vocabulary.unlink()
        if not tokenizer.chat_template:  # Ollama may keep it in the model's manifest, as a Go template
            log.warning("GGUF %s holds no chat template: chat requests need one, `--chat-template FILE` (GPT-OSS's "
                        "chat_template.jinja from openai/gpt-oss-20b); /v1/completions works without", source)
    else:
        tokenizer = load_gguf_tokenizer(source, reads_config=arch not in OWN_CONFIG_ARCHS)
    pre = reader.fields.get("tokenizer.ggml.pre")
    if arch in OLLAMA_SPLIT_RULES and pre is not None and pre.contents() == "default":  # Ollama's: unnamed
        apply_file_split_rule(tokenizer, OLLAMA_SPLIT_RULES[arch])
    if arch == "gemma4" and reader.fields["tokenizer.ggml.model"].contents() != "gemma4":  # Ollama's: `llama`
        log.warning("GGUF %s: its Gemma 4 vocabulary is of type %r (llama.cpp writes `gemma4`, Ollama `llama`) and is "
                    "read as transformers reads that type, not checked against Gemma 4's own tokenizer", source,
                    reader.fields["tokenizer.ggml.model"].contents())
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, attribute, None) is None and getattr(tokenizer, attribute, None) is not None:
            setattr(config, attribute, getattr(tokenizer, attribute))
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    ends = [int(reader.fields[key].contents()) for key in END_ID_KEYS if key in reader.fields]
    vocab = tokenizer.get_vocab()
    ends += [vocab[token] for token in TURN_END_TOKENS.get(config.model_type, ()) if token in vocab]
    if ends:
        generation.eos_token_id = sorted(set(ends), key=ends.index)
    generation.save_pretrained(out)
