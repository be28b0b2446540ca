"""Architecture hyper-parameters of Molt's transformer family, and their mapping to HF `config.json`.

One dataclass describes every supported model (Llama, Qwen2, Qwen3 dense, Qwen3-MoE). Each HF
`model_type` registers a reader of its config keys (one writer serves all); an unknown `model_type`
or an unsupported feature is an error naming the key. Knows nothing of weights."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from molt.registry import Registry


@dataclass
class VisionConfig:
    """Shape of the vision tower: square RGB images -> patches -> encoder layers -> LM embeddings."""

    image_size: int = 32
    patch_size: int = 8
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size or self.hidden_size % self.num_heads:
            raise ValueError("vision_config: image_size must be a multiple of patch_size, hidden_size of num_heads")

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass
class TransformerConfig:
    """Shape and numerics of one decoder-only transformer (dense or sparse MoE)."""

    model_type: str = "qwen3"
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = True
    # sparse MoE (Qwen3-MoE style); num_experts == 0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_fp32: bool = True  # router matmul/softmax and the expert combine in fp32 (not an HF key)
    # special token ids carried through to config.json
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # vision tower (a VLM); images enter as embeddings at `image_token_id` placeholder positions
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    # the source folder's generation_config.json (sampling defaults, extra eos ids that transformers and vLLM read),
    # written back beside the model's checkpoints
    generation_config: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.vision, dict):
            self.vision = VisionConfig(**self.vision)
        from molt.models.rope import ROPE_TYPES  # it reads this config

        if (kind := (self.rope_scaling or {}).get("rope_type", "default")) not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported; supported: {sorted(ROPE_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError("num_experts_per_tok must be in [1, num_experts]")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("moe_intermediate_size must be > 0 when num_experts > 0")

    def stop_ids(self) -> list[int]:
        """The eos ids of config.json and of the source's generation_config.json, where generation stops (e.g.
        Qwen2.5's `<|endoftext|>` beside `<|im_end|>`); an unreadable generation config adds none."""
        ids = [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id or [])
        try:
            extra = json.loads(self.generation_config or "{}").get("eos_token_id")
        except (ValueError, AttributeError):
            extra = None
        extra = [extra] if isinstance(extra, int) else [i for i in extra or [] if isinstance(i, int)]
        return ids + [i for i in extra if i not in ids]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` uses the sparse MoE block (Qwen3-MoE placement rule)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def context_length(self) -> int:
        """Positions the model is made for: max_position_embeddings, or a RoPE scaling's extended context (its
        original context x factor, e.g. YaRN)."""
        scaling = self.rope_scaling or {}
        original = int(scaling.get("original_max_position_embeddings") or self.max_position_embeddings)
        return max(self.max_position_embeddings, int(original * float(scaling.get("factor") or 1.0)))


# the MoE fields, named as in config.json (space-separated)
MOE_KEYS = "num_experts num_experts_per_tok moe_intermediate_size norm_topk_prob decoder_sparse_step mlp_only_layers"

# the config.json keys every family reads and writes as they are (key:field where the TransformerConfig field differs)
HF_KEYS = """model_type vocab_size hidden_size intermediate_size num_hidden_layers:num_layers
    num_attention_heads:num_heads num_key_value_heads:num_kv_heads head_dim rms_norm_eps max_position_embeddings
    tie_word_embeddings bos_token_id eos_token_id pad_token_id"""
HF_FIELDS = [(key, field or key) for key, _, field in (k.partition(":") for k in HF_KEYS.split())]

# model_type -> its config.json reader (HF keys -> TransformerConfig fields); all families share one writer
FAMILIES: Registry[Callable[[dict[str, Any]], dict[str, Any]]] = Registry("model family")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either transformers-5 `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    scaling = params if params.get("rope_type", "default") != "default" else None
    return theta, scaling


def _read_common(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported")
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    defaults = dict(num_key_value_heads=heads, head_dim=hf["hidden_size"] // heads, rms_norm_eps=1e-6)
    defaults |= dict(max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None)
    given = defaults | dict(eos_token_id=None, pad_token_id=None) | {k: v for k, v in hf.items() if v is not None}
    fields = {field: given[key] for key, field in HF_FIELDS}  # a required key missing: KeyError, as before
    return fields | dict(rope_theta=theta, rope_scaling=scaling)


@FAMILIES.register("llama", architecture="LlamaForCausalLM")
def _read_llama(hf: dict[str, Any]) -> dict[str, Any]:
    bias = hf.get("attention_bias", False)
    return _read_common(hf) | dict(qkv_bias=bias, o_bias=bias, mlp_bias=hf.get("mlp_bias", False), qk_norm=False)


@FAMILIES.register("qwen2", architecture="Qwen2ForCausalLM")
def _read_qwen2(hf: dict[str, Any]) -> dict[str, Any]:
    return _read_common(hf) | dict(qkv_bias=True, o_bias=False, qk_norm=False)


@FAMILIES.register("qwen3", architecture="Qwen3ForCausalLM")
def _read_qwen3(hf: dict[str, Any]) -> dict[str, Any]:
    bias = hf.get("attention_bias", False)
    return _read_common(hf) | dict(qkv_bias=bias, o_bias=bias, qk_norm=True)


@FAMILIES.register("qwen3_moe", architecture="Qwen3MoeForCausalLM")
def _read_qwen3_moe(hf: dict[str, Any]) -> dict[str, Any]:
    return _read_qwen3(hf) | dict(
        num_experts=hf.get("num_experts") or hf.get("num_local_experts") or 0,
        num_experts_per_tok=hf.get("num_experts_per_tok", 2),
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=hf.get("norm_topk_prob", False),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=list(hf.get("mlp_only_layers") or []),
    )


def config_to_hf(cfg: TransformerConfig, dtype: str = "float32") -> dict[str, Any]:
    """HF `config.json` dict for `cfg` (readable by transformers and vLLM); `dtype`: the saved weights'."""
    rope = {"rope_type": "default"} | (cfg.rope_scaling or {}) | {"rope_theta": cfg.rope_theta}
    hf: dict[str, Any] = {"architectures": [FAMILIES.info(cfg.model_type)["architecture"]]}
    hf |= {key: getattr(cfg, field) for key, field in HF_FIELDS}
    hf |= dict(hidden_act="silu", rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling)  # older readers: these two
    hf |= dict(rope_parameters=rope, attention_bias=cfg.qkv_bias, torch_dtype=dtype)
    if cfg.model_type == "llama":
        hf["mlp_bias"] = cfg.mlp_bias
    if cfg.num_experts:
        hf |= {key: getattr(cfg, key) for key in MOE_KEYS.split()}
    if cfg.vision is not None:
        hf |= dict(vision_config=dataclasses.asdict(cfg.vision), image_token_id=cfg.image_token_id)
    return hf


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> TransformerConfig:
    """TransformerConfig from an HF config dict; unsupported `model_type` is an error naming `source`."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{source}: model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    vision = hf.get("vision_config")
    try:
        fields = FAMILIES[model_type](_with_family_defaults(hf))
        return TransformerConfig(**fields, vision=vision, image_token_id=hf.get("image_token_id") if vision else None)
    except KeyError as e:
        raise ValueError(f"{source}: no {e.args[0]!r}, which a {model_type} config needs") from None
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _with_family_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` with the keys it leaves out at their values in transformers' config class of its family (Qwen3-MoE's
    8 experts per token, Qwen3's head_dim 128, Qwen2's 32768 positions, llama3 RoPE's original length), as
    transformers loads the folder; its validation errors (a RoPE type without its parameters) as ValueErrors. The
    model's shape has no default that could stand in: a KeyError naming the first of those it lacks."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    shape = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
    if missing := [key for key in shape if hf.get(key) is None]:
        raise KeyError(missing[0])
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings about the user's config: the errors below say what matters
    try:
        filled = CONFIG_MAPPING[hf["model_type"]](**hf).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers' (and huggingface_hub's) validation, in its own words
        raise ValueError(str(e).strip("'\"")) from None
    finally:
        hf_logging.set_verbosity(level)
    return filled | hf


# Built-in presets: random-weight models for tests and the default job (vocab sized for the built-in
# tokenizer; `vocab_size` is overwritten with the real tokenizer size when a model is built).
# Fields left out take TransformerConfig's defaults.
PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(),  # the defaults: 4 layers, 256 wide, 4 heads, 2 kv heads
    "small": TransformerConfig(hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8, num_kv_heads=4),
    "tiny-moe": TransformerConfig(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=192),
    # the shape of Qwen3-0.6B (random weights; vocab from the tokenizer): GPU benchmarks and checks
    "qwen3-0.6b": TransformerConfig(
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
    ),
    # `image_token_id` is set from the tokenizer (its `<|image|>` token) when the model is built
    "tiny-vlm": TransformerConfig(
        hidden_size=128,
        intermediate_size=384,
        num_layers=3,
        head_dim=32,
        vision=VisionConfig(hidden_size=64, intermediate_size=128),
    ),
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """A copy of preset `name` with `overrides` applied."""
    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r} is unknown; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
