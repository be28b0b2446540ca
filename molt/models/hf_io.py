"""Hugging Face model folders in and out: `config.json` + `*.safetensors` (sharded or not).

Molt's parameter names are HF's without the `model.` prefix, except MoE experts, which Molt stacks
into [E, ...] tensors; `to_hf_state` / `load_weights` translate with one regex rule (the one place these
names are known; the vLLM adapter uses `hf_tensors`). `load_weights` copies in place: strict for a checkpoint (a
missing or unexpected weight is an error listing the names), partial for an engine's weight swap. Saving is atomic
(temp folder, then rename)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from molt.errors import UserError
from molt.models.config import TransformerConfig, config_from_hf, config_to_hf
from molt.models.tokenizer import save_tokenizer
from molt.models.transformer import Transformer

INDEX, GENERATION_CONFIG = "model.safetensors.index.json", "generation_config.json"
IGNORED_HF_KEYS = re.compile(r"(rotary_emb\.)?inv_freq$")  # rotary buffers: recomputed, never loaded


# MoE experts: one stacked [E, ...] tensor per projection in Molt, one tensor per expert and projection in HF
EXPERTS = re.compile(r"(layers\.\d+\.mlp\.)(gate_up_proj|down_proj)$")
EXPERT_PROJS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _hf_names(name: str, cfg: TransformerConfig) -> tuple[list[str], int]:
    """HF names of Molt parameter `name` (HF keeps all but the head under `model.`), and how many HF
    projections per expert it stacks (0: not an expert tensor)."""
    names, per_expert = [name], 0
    if m := EXPERTS.match(name):
        projs = EXPERT_PROJS[m[2]]
        names = [f"{m[1]}experts.{e}.{p}.weight" for e in range(cfg.num_experts) for p in projs]
        per_expert = len(projs)
    return [n if n.startswith("lm_head") else f"model.{n}" for n in names], per_expert


def hf_tensors(name: str, tensor: torch.Tensor, cfg: TransformerConfig) -> list[tuple[str, torch.Tensor]]:
    """Molt parameter `name` as HF-named tensors (one per expert projection for stacked MoE experts); views of
    `tensor` where the layouts allow, so writing into them writes into it."""
    names, per_expert = _hf_names(name, cfg)
    parts = [part for expert in tensor for part in expert.chunk(per_expert)] if per_expert else [tensor]
    return list(zip(names, parts, strict=True))


def hf_views(params: Mapping[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF name -> the view of a Molt parameter it is (an expert's slice of a stacked tensor, or the whole one)."""
    return {hf: view for name, param in params.items() for hf, view in hf_tensors(name, param, cfg)}


def _own_params(model: Transformer) -> dict[str, torch.Tensor]:
    tied = model.cfg.tie_word_embeddings  # a tied head is the embedding matrix, not a weight of its own
    return {name: tensor for name, tensor in model.state_dict().items() if not (tied and name == "lm_head.weight")}


def to_hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under HF names and layouts (what transformers and vLLM expect)."""
    return hf_views({name: tensor.detach() for name, tensor in _own_params(model).items()}, model.cfg)


@torch.no_grad()
def load_weights(
    model: Transformer,
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    source: str | None = None,
) -> int:
    """Copy `weights` (Molt or HF names: HF per-expert tensors land in a slice of Molt's stacked experts) into
    `model`'s parameters in place; returns the number of tensors copied. Nothing is reallocated (a running engine's
    cache and compiled state stay valid). Unknown names or shape mismatches are an error listing them, raised before
    anything is copied; with `source` (a whole checkpoint) so are missing weights, and a tied head it stores is
    ignored if it is the embedding (some tied checkpoints store the shared matrix twice), else an error."""
    params = model.state_dict(keep_vars=True)
    params |= hf_views(params, model.cfg)
    skip = "lm_head.weight" if source is not None and model.cfg.tie_word_embeddings else None
    plan, unknown, mismatched, stored_head = {}, [], [], None
    for name, tensor in weights.items() if isinstance(weights, Mapping) else weights:
        if name == skip:
            stored_head = tensor
        if IGNORED_HF_KEYS.search(name) or name == skip:
            continue
        dest = params.get(name)
        if dest is None:
            unknown.append(name)
        elif tuple(dest.shape) != tuple(tensor.shape):
            mismatched.append(f"{name}: got {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        else:
            plan[name] = (dest, tensor)
    given = plan.keys() | {m.partition(":")[0] for m in mismatched}
    missing = sorted(hf_views(_own_params(model), model.cfg).keys() - given) if source is not None else []
    if missing or unknown or mismatched:
        where = "update_weights: " if source is None else f"{source}: missing weights {missing}; "
        error = ValueError if source is None else UserError  # a model folder's weights: the user's to mend
        raise error(f"{where}unknown names {sorted(unknown)}; shape mismatches {mismatched}")
    for dest, tensor in plan.values():
        dest.copy_(tensor)
    embed = model.embed_tokens.weight
    if stored_head is not None and not torch.equal(stored_head.to(embed), embed):
        raise UserError(f"{source}: config.json has tie_word_embeddings true, but the weights hold an lm_head.weight "
                        "other than the embedding (transformers keeps that head): set tie_word_embeddings to false "
                        "in config.json, or drop lm_head.weight")  # fmt: skip
    return len(plan)


class LazyTensors(Mapping):
    """Name -> tensor over one or more safetensors files, read on access."""

    def __init__(self, files: list[Path], dtype: torch.dtype):
        self.where, self.dtype, first = {}, dtype, {}
        for file in files:
            handle = _open(file)
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle
                if name in first:
                    raise UserError(f"weight {name!r} is in both {first[name]} and {file}: which one is the model's?")
                self.where[name], first[name] = handle, file

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name).to(self.dtype)

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def _open(file: Path):
    if not file.exists():
        raise UserError(f"{file}: named in {file.parent / INDEX} but not in the folder (an incomplete download?)")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: a truncated or foreign file
        raise UserError(f"{file}: cannot read these weights ({e}); is the file complete (not truncated)?") from None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of HF model folder `folder` as transformers picks them: `model.safetensors`, else its
    index's shards, else its only `*.safetensors`; FileNotFoundError if none, a UserError if several and no index."""
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    if (folder / INDEX).exists():
        return sorted({folder / f for f in json.loads((folder / INDEX).read_text())["weight_map"].values()})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights found (only safetensors is supported)")
    if len(files) > 1:
        raise UserError(f"{folder}: {len(files)} *.safetensors files ({', '.join(f.name for f in files[:4])}) but no "
                        f"model.safetensors or {INDEX}: which are the model's?")  # fmt: skip
    return files


def load_config(folder: str | os.PathLike) -> TransformerConfig:
    """TransformerConfig from `folder/config.json`, with the folder's `generation_config.json` (if any) as text."""
    path, generation = Path(folder) / "config.json", Path(folder) / GENERATION_CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face model folder")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    cfg = config_from_hf(hf, source=str(path))
    cfg.generation_config = generation.read_text() if generation.exists() else ""
    return cfg


def from_pretrained(
    folder: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **settings: Any
) -> Transformer:
    """Build a Transformer from an HF model folder (Llama / Qwen2 / Qwen3 / Qwen3-MoE); `settings` are Molt's own
    config fields that no config.json holds (e.g. `router_fp32`)."""
    folder = Path(folder)
    model = empty_model(dataclasses.replace(load_config(folder), **settings), dtype, device)
    load_weights(model, LazyTensors(weight_files(folder), dtype), source=str(folder))
    return model


def empty_model(cfg: TransformerConfig, dtype: torch.dtype, device: str | torch.device = "cpu") -> Transformer:
    """A Transformer of `cfg` in `dtype` on `device` with uninitialised weights, to load weights into (built on the
    meta device: no random init)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)  # `Transformer._apply` recomputes the rotary buffer
    if cfg.tie_word_embeddings:  # materialising from meta breaks the tie
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _umask() -> int:
    """The process umask, read from /proc where possible (setting it to read it races with other threads)."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.exists() else []:
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_like_new_files(folder: Path) -> None:
    """Give `folder` and everything in it the modes the umask gives new files and folders (e.g. 755 / 644)."""
    mask = _umask()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp folder beside `folder`; on success it replaces `folder` (a model folder or an empty one: other
    files are refused, not deleted), on error it is removed."""
    folder = Path(folder)
    if folder.is_dir() and any(folder.iterdir()) and not (folder / "config.json").exists():
        raise FileExistsError(f"{folder} holds files and is no model folder; a model is written to a new or empty "
                              "folder (or over a model folder, which it replaces whole)")  # fmt: skip
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield tmp
        share_like_new_files(tmp)  # mkdtemp makes it 0700, safetensors writes 0600: read like any other the user makes
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_pretrained(model: Transformer, folder: str | os.PathLike, tokenizer=None) -> Path:
    """Write an HF model folder atomically (config.json, the source's generation_config.json, safetensors shards,
    tokenizer if given)."""
    with atomic_folder(folder) as tmp:
        dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")  # the weights' as written
        (tmp / "config.json").write_text(json.dumps(config_to_hf(model.cfg, dtype), indent=2) + "\n")
        if model.cfg.generation_config:
            (tmp / GENERATION_CONFIG).write_text(model.cfg.generation_config)
        _write_shards(to_hf_state(model), tmp)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
    return Path(folder)


def _write_shards(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int = 4 << 30) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous().cpu()
        size += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}}
    (folder / INDEX).write_text(json.dumps(index | {"weight_map": weight_map}, indent=2))
