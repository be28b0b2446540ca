"""Molt's transformer against `transformers` on random-weight tiny configs, both load directions."""

import pytest
import torch
import transformers
from conftest import random_hf  # noqa: I001 - tests/conftest.py

from molt.models import KVCache, doc_ids_from_lengths, from_pretrained, save_pretrained

COMMON = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=6,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
CASES = {
    "llama-gqa-untied-llama3rope": transformers.LlamaConfig(
        **COMMON,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "llama-mha-tied-linear": transformers.LlamaConfig(
        **COMMON,
        num_key_value_heads=6,
        tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),
    "qwen2-qkvbias-tied": transformers.Qwen2Config(**COMMON, num_key_value_heads=3, tie_word_embeddings=True),
    "qwen2-yarn": transformers.Qwen2Config(
        **COMMON,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    ),
    "qwen3-qknorm-untied": transformers.Qwen3Config(
        **COMMON,
        num_key_value_heads=2,
        head_dim=12,
        tie_word_embeddings=False,
        rope_theta=5e5,
    ),
    "qwen3-moe": transformers.Qwen3MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    "qwen3-moe-mixed-layers": transformers.Qwen3MoeConfig(
        **COMMON,
        num_key_value_heads=3,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = random_hf(CASES[request.param], std=0.3)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, from_pretrained(folder).eval()


def _hf_logits(hf, ids_bt):
    with torch.no_grad():
        return hf(input_ids=ids_bt).logits


def test_logits_match_unpacked(pair):
    hf, molt = pair
    ids_bt = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = molt(ids_bt)
    assert (ours - _hf_logits(hf, ids_bt)).abs().max() <= 1e-4


def test_logits_match_packed(pair):
    hf, molt = pair
    g = torch.Generator().manual_seed(2)
    lengths = [[7, 20, 5], [31], [12, 12]]
    doc_ids, positions = doc_ids_from_lengths(lengths, row_len=34)
    ids_bt = torch.randint(0, 97, (3, 34), generator=g)
    with torch.no_grad():
        ours = molt(ids_bt, positions, doc_ids_bt=doc_ids)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            ref = _hf_logits(hf, ids_bt[row : row + 1, start : start + n])[0]
            assert (ours[row, start : start + n] - ref).abs().max() <= 1e-4
            start += n


def test_incremental_decode_with_cache_matches_full_forward(pair):
    _, molt = pair
    ids_bt = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    cache = KVCache(molt.cfg, batch=2, max_len=32)
    with torch.no_grad():
        full = molt(ids_bt)
        prefill = molt(ids_bt[:, :16], torch.arange(16).expand(2, 16), cache=cache)
        steps = [molt(ids_bt[:, t : t + 1], torch.full((2, 1), t), cache=cache) for t in range(16, 24)]
    assert (prefill - full[:, :16]).abs().max() <= 1e-4
    assert (torch.cat(steps, dim=1) - full[:, 16:]).abs().max() <= 1e-4


def test_molt_saved_folder_loads_in_transformers(pair, tmp_path):
    hf, molt = pair
    save_pretrained(molt, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids_bt = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (back(input_ids=ids_bt).logits - molt(ids_bt)).abs().max() <= 1e-4
        assert (back(input_ids=ids_bt).logits - _hf_logits(hf, ids_bt)).abs().max() <= 1e-4


def test_model_folders_load_as_transformers_picks_them_and_saves_keep_what_is_beside(tmp_path):
    """model.safetensors wins over a stray *.safetensors beside it; generation_config.json is written back; a
    folder of other files is refused, not emptied; a broken config is an error naming the file."""
    import json

    from molt.errors import UserError

    hf = random_hf("qwen3")
    hf.generation_config.do_sample, hf.generation_config.temperature, hf.generation_config.eos_token_id = (
        True,
        0.7,
        [0, 2],
    )
    hf.save_pretrained(tmp_path / "m")
    random_hf("qwen3", seed=1).save_pretrained(tmp_path / "other")
    (tmp_path / "other/model.safetensors").rename(tmp_path / "m/model_before.safetensors")
    ids_bt = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (from_pretrained(tmp_path / "m")(ids_bt) - _hf_logits(hf, ids_bt)).abs().max() <= 1e-4
    assert from_pretrained(tmp_path / "m").cfg.stop_ids() == [0, 2]  # generation_config.json's: the engine stops there
    save_pretrained(from_pretrained(tmp_path / "m"), tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert (back.generation_config.temperature, back.generation_config.eos_token_id) == (0.7, [0, 2])
    (tmp_path / "m/model.safetensors").rename(tmp_path / "m/a.safetensors")  # two candidates, no index: which?
    with pytest.raises(UserError, match="2 \\*.safetensors files .* which are the model's"):
        from_pretrained(tmp_path / "m")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes/notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds files and is no model folder"):
        save_pretrained(from_pretrained(tmp_path / "out"), tmp_path / "notes")
    assert (tmp_path / "notes/notes.txt").read_text() == "mine"
    config = json.loads((tmp_path / "out/config.json").read_text())
    dynamic = {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
    for change, message in [(dynamic, "rope_type='dynamic' is not"), ({"num_attention_heads": None}, "no 'num_att")]:
        broken = {k: v for k, v in (config | change).items() if v is not None}
        (tmp_path / "out/config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=f"config.json: .*{message}"):
            from_pretrained(tmp_path / "out")


def test_packing_more_than_a_row_holds_names_the_row():
    with pytest.raises(ValueError, match="row 1: samples of total length 35 exceed row length 34"):
        doc_ids_from_lengths([[7, 20], [30, 5]], row_len=34)


def test_keys_a_config_leaves_out_take_transformers_family_defaults(tmp_path):
    """Qwen3-MoE without num_experts_per_tok ran 2 experts where transformers runs 8 (logits off by 2.7); llama3
    RoPE without original_max_position_embeddings was an internal KeyError; a tied config storing another head
    silently lost it (logits off by 17.7)."""
    import json

    import safetensors.torch
    from conftest import hf_config

    from molt.errors import UserError

    hf = random_hf(hf_config("qwen3-moe", num_experts=8, num_experts_per_tok=8))
    hf.save_pretrained(tmp_path / "moe")
    config = json.loads((tmp_path / "moe/config.json").read_text())
    (tmp_path / "moe/config.json").write_text(
        json.dumps({k: v for k, v in config.items() if k != "num_experts_per_tok"})
    )
    ids_bt = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (from_pretrained(tmp_path / "moe")(ids_bt) - _hf_logits(hf, ids_bt)).abs().max() <= 1e-4
    rope = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    (tmp_path / "moe/config.json").write_text(json.dumps(config | {"rope_parameters": rope}))
    assert from_pretrained(tmp_path / "moe").cfg.rope_scaling["original_max_position_embeddings"] > 0
    (tmp_path / "moe/config.json").write_text(json.dumps(config | {"rope_parameters": {"rope_type": "linear"}}))
    with pytest.raises(ValueError, match="config.json: .*factor"):  # transformers' own check, not a tokenizer's
        from_pretrained(tmp_path / "moe")

    tied = random_hf(hf_config(tie_word_embeddings=True))
    tied.save_pretrained(tmp_path / "tied")
    weights = safetensors.torch.load_file(tmp_path / "tied/model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # the shared matrix stored twice: fine
    safetensors.torch.save_file(weights, tmp_path / "tied/model.safetensors", metadata={"format": "pt"})
    from_pretrained(tmp_path / "tied")
    weights["lm_head.weight"] = torch.randn_like(weights["lm_head.weight"])
    safetensors.torch.save_file(weights, tmp_path / "tied/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="tie_word_embeddings true, but the weights hold an lm_head.weight other"):
        from_pretrained(tmp_path / "tied")
