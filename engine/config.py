"""Engine configuration: a frozen dataclass, validated on construction.

The server's CLI, `MOE_SERVE_*` variables and YAML presets map one-to-one onto these
fields (flag `--expert-cache-gb` ↔ field `expert_cache_gb`).
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "float16", "bfloat16")
POLICY_NAMES = ("sparsity-aware", "lru", "lfu")
EXPERT_DTYPES = ("auto", "bf16", "int8", "int4", "int4-mixed")
MAX_NAME_CHARS = 256
NAME_SEPARATOR = ","  # between the names of --served-model-name (a model id never holds one)


CPU_EXPERTS = ("auto", "off")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local HF folder or hub id; None: the built-in demo model
    served_model_name: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA, float32 on CPU
    expert_cache_experts: int | None = None  # device cache size in experts ...
    expert_cache_gb: float | None = None  # ... or in GiB; neither: free CUDA memory but 2 GiB, or on CPU all experts (in RAM)
    host_cache_gb: float | None = None  # RAM tier budget; None: all experts that fit in the available RAM
    policy: str = "sparsity-aware"
    prefetch: bool = True
    cpu_experts: str = "auto"  # auto | off: on CUDA, compute some misses on the host cores (when measured faster)
    eamc_path: str | None = None  # None: one file per model under the state folder
    eamc_capacity: int = 256  # cache/eamc.py DEFAULT_CAPACITY: no gain beyond ~100 entries in replay
    record_trace: str | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    expert_dtype: str = "auto"  # auto / bf16: the experts as the checkpoint holds them (in --dtype); int8 | int4 | int4-mixed
    prefix_cache: int = 4  # KV caches of finished requests kept for a prompt that starts the same way; 0: off
    prefix_cache_host_gb: float | None = None  # host RAM for kept KV caches off the device; None: auto, 0: off
    expert_group_size: int | None = None  # 0: one scale per output channel; None: int8 per channel, int4 (and int4-mixed's int4 weights) 32
    chat_template: str | None = None  # a Jinja file, or the template text itself; None: the model's own

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, not {self.policy!r}")
        if self.cpu_experts not in CPU_EXPERTS:
            raise ValueError(f"cpu_experts must be one of {', '.join(CPU_EXPERTS)}, not {self.cpu_experts!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert-dtype must be one of {', '.join(EXPERT_DTYPES)}, not {self.expert_dtype!r}")
        if self.expert_group_size is not None and self.expert_group_size < 0:
            raise ValueError(f"expert-group-size must be 0 (per channel) or positive, not {self.expert_group_size}")
        if self.served_model_name is not None and not all(map(_is_printable_name, self.served_names)):
            raise ValueError(f"served-model-name must be names of 1 to {MAX_NAME_CHARS} printable characters, "
                             f"separated by commas, not {self.served_model_name!r}")
        if self.expert_cache_experts is not None and self.expert_cache_gb is not None:
            raise ValueError("give --expert-cache-experts or --expert-cache-gb, not both")
        positive = {
            "expert_cache_experts": self.expert_cache_experts,
            "expert_cache_gb": self.expert_cache_gb,
            "host_cache_gb": self.host_cache_gb,
            "max_model_len": self.max_model_len,
            "eamc_capacity": self.eamc_capacity,
        }
        if self.prefix_cache < 0:
            raise ValueError(f"prefix-cache must be 0 (off) or a number of entries, not {self.prefix_cache}")
        if self.prefix_cache_host_gb is not None and not 0 <= self.prefix_cache_host_gb < float("inf"):
            raise ValueError(f"prefix-cache-host-gb must be a number of GiB >= 0, not {self.prefix_cache_host_gb}")
        for name, value in positive.items():
            if value is not None and value <= 0:
                raise ValueError(f"{name.replace('_', '-')} must be positive, not {value}")


    @property
    def served_names(self) -> tuple[str, ...]:
        """`served_model_name`'s comma-separated names (clients may send any; responses carry the first)."""
        if self.served_model_name is None:
            return ()
        return tuple(self.served_model_name.split(NAME_SEPARATOR))


def _is_printable_name(name: str) -> bool:
    """What clients send back and logs quote: no control characters, no lone surrogates."""
    return 0 < len(name) <= MAX_NAME_CHARS and name.isprintable() and name.strip() == name
