"""Tokenizer tests: the built-in byte tokenizer, HF folder round trips, chat rendering, assistant masks."""

import json
import random

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from molt.models.tokenizer import (
    BUILTIN_TOKENIZER_VOCAB_SIZE,
    ChatTemplateError,
    apply_chat_template,
    assistant_mask,
    build_builtin_tokenizer,
    load_tokenizer,
    render_chat,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
        ],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "rainy"},
    {"role": "assistant", "content": "Paris: sunny. Oslo: rainy ☔."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]
EXPECTED_TEXT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    "You may call the functions below. Each one is described by a JSON signature inside <tools></tools>:\n"
    "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments between <tool_call> and "
    '</tool_call>:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>'
    "<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"
    "<|im_end|>\n"
    "<|im_start|>assistant\nParis: sunny. Oslo: rainy ☔.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n"
    "<|im_start|>assistant\nYou're welcome.<|im_end|>\n"
)
EXPECTED_ASSISTANT_SPANS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
    "Paris: sunny. Oslo: rainy ☔.<|im_end|>",
    "You're welcome.<|im_end|>",
]


@pytest.fixture(scope="module")
def tok():
    return build_builtin_tokenizer()


def masked_spans(tokenizer, ids, mask):
    """Decoded text of each maximal run of mask == 1."""
    spans, run = [], []
    for token, bit in [*zip(ids, mask, strict=True), (None, 0)]:
        if bit:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


def random_text(rng: random.Random, n: int) -> str:
    """Random code points from ASCII to astral planes (no surrogates), with newlines and controls."""
    pools = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(pools))) for _ in range(n))


def test_builtin_roundtrips_any_text_as_utf8_bytes(tok):
    rng = random.Random(0)
    texts = [random_text(rng, rng.randint(0, 200)) for _ in range(50)]
    texts += ["", " ", "\r\n\t\x00", "".join(map(chr, range(256))), "e\u0301 👩‍👩‍👧 中文", "  two  spaces "]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))  # one token per byte, id = byte
        assert tok.decode(ids) == text


def test_builtin_special_tokens_and_fixed_ids(tok):
    assert len(tok) == BUILTIN_TOKENIZER_VOCAB_SIZE == 265
    assert tok.encode("<|endoftext|><|im_start|><|im_end|>", add_special_tokens=False) == [256, 257, 258]
    markup = "<tool_call></tool_call><tool_response></tool_response><think></think>"
    assert tok.encode(markup, add_special_tokens=False) == list(range(259, 265))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token) == (256, 258, None)
    assert tok.encode("A") == [65]  # no BOS/EOS added by default
    # Control tokens are dropped when skipping specials; tool markup stays for the agent to parse.
    text = "<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "assistant\n<tool_call>{}</tool_call>"


def test_builtin_is_deterministic(tok):
    assert build_builtin_tokenizer().backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_saved_folder_reloads_with_identical_ids_and_template(tok, tmp_path):
    build_builtin_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tok.chat_template
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((tmp_path / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"
    for reloaded in (AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)):
        assert isinstance(reloaded, PreTrainedTokenizerFast)
        assert len(reloaded) == len(tok)
        assert (reloaded.eos_token, reloaded.pad_token) == ("<|im_end|>", "<|endoftext|>")
        for text in ["héllo wörld 🎉", EXPECTED_TEXT]:
            assert reloaded.encode(text) == tok.encode(text)
        assert render_chat(reloaded, CONVERSATION, tools=TOOLS) == EXPECTED_TEXT
        assert apply_chat_template(reloaded, CONVERSATION, tools=TOOLS) == tok.encode(EXPECTED_TEXT)


def test_chat_template_renders_tools_and_tool_calls(tok):
    assert render_chat(tok, CONVERSATION, tools=TOOLS) == EXPECTED_TEXT


def test_generation_prompt_and_plain_chat(tok):
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat(tok, messages) == "<|im_start|>user\nHi<|im_end|>\n"
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(tok, messages, add_generation_prompt=True) == prompt
    ids = apply_chat_template(tok, messages, add_generation_prompt=True)
    assert ids == tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # nothing (no BOS) before the template text
    parts = [{"type": "text", "text": "Hi"}]
    assert render_chat(tok, [{"role": "user", "content": parts}]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_assistant_mask_is_exactly_assistant_content_and_end_token(tok):
    ids, mask = assistant_mask(tok, CONVERSATION, TOOLS)
    assert ids == apply_chat_template(tok, CONVERSATION, tools=TOOLS) == tok.encode(EXPECTED_TEXT)
    assert len(mask) == len(ids) and set(mask) == {0, 1}
    assert masked_spans(tok, ids, mask) == EXPECTED_ASSISTANT_SPANS
    # The newline ChatML adds after <|im_end|> is prompt for the next turn, not a generated token.
    im_end = tok.eos_token_id
    assert all(mask[i] == 1 and mask[i + 1] == 0 for i, t in enumerate(ids[:-1]) if t == im_end and mask[i])
    assert mask[-2:] == [1, 0] and ids[-1] == tok.encode("\n")[0]


def test_assistant_mask_custom_end_of_turn(tok):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ids, mask = assistant_mask(tok, messages, end_of_turn=["</never>"])  # no stop token: whole turn
    assert masked_spans(tok, ids, mask) == ["b<|im_end|>\n"]


def test_an_assistant_turn_of_weight_0_is_not_trained(tok):
    """OpenAI's chat fine-tuning format: `"weight": 0` on an assistant message keeps it as context only."""
    bad = {"role": "assistant", "content": "bad", "weight": 0}
    good = {"role": "assistant", "content": "good", "weight": 1}
    messages = [{"role": "user", "content": "a"}, bad, {"role": "user", "content": "again"}, good]
    ids, mask = assistant_mask(tok, messages)
    assert masked_spans(tok, ids, mask) == ["good<|im_end|>"]


def test_assistant_mask_splits_tokens_that_merge_across_span_edges(tok):
    """A tokenizer that merges "\\n" + "O" across the prompt/answer edge is tokenized piece-wise there."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["model"]["vocab"]["ĊO"] = 256  # added tokens move up by one
    spec["model"]["merges"] = [["Ċ", "O"]]
    spec["added_tokens"] = [{**t, "id": t["id"] + 1} for t in spec["added_tokens"]]
    merging = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token="<|im_end|>",
        chat_template=tok.chat_template,
    )
    messages = [{"role": "user", "content": "Ok?"}, {"role": "assistant", "content": "OK\nOK"}]
    ids, mask = assistant_mask(merging, messages)
    assert masked_spans(merging, ids, mask) == ["OK\nOK<|im_end|>"]
    merged_id = merging.convert_tokens_to_ids("ĊO")
    assert merged_id in ids[mask.index(1) :]  # the merge inside the answer is kept...
    whole = apply_chat_template(merging, messages)
    assert ids != whole and merging.decode(ids) == merging.decode(whole)  # ...the one across the edge is not


def test_assistant_mask_rejects_template_that_rewrites_history(tok):
    # Like Qwen3: earlier assistant turns lose their reasoning once a later turn exists.
    template = (
        "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' -}}"
        "{%- if m.role == 'assistant' and not loop.last -%}{{- m.content.split('</think>')[-1] -}}"
        "{%- else -%}{{- m.content -}}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>easy</think>2"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>also easy</think>4"},
    ]
    original = tok.chat_template
    try:
        tok.chat_template = template
        ids, mask = assistant_mask(tok, messages[:2])  # one assistant turn: nothing is rewritten
        assert masked_spans(tok, ids, mask) == ["<think>easy</think>2<|im_end|>"]
        with pytest.raises(ChatTemplateError, match="re-renders history"):
            assistant_mask(tok, messages)
    finally:
        tok.chat_template = original


def test_assistant_mask_needs_a_prompt(tok):
    with pytest.raises(ChatTemplateError, match="message 0"):
        assistant_mask(tok, [{"role": "assistant", "content": "hi"}])


def test_load_tokenizer_errors_name_the_path(tmp_path):
    missing = tmp_path / "no_such_tokenizer"
    with pytest.raises(FileNotFoundError, match="no_such_tokenizer"):
        load_tokenizer(missing)
    empty = tmp_path / "empty_folder"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="empty_folder.*not a tokenizer folder"):
        load_tokenizer(empty)
    broken = tmp_path / "broken_folder"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match="broken_folder"):
        load_tokenizer(broken)


def test_template_args_reach_every_rendering_and_travel_with_the_tokenizer():
    """Qwen3's enable_thinking=false could not be given: training and eval only ever rendered thinking mode."""
    import pickle

    from molt.cli.build import build_tokenizer
    from molt.config import ConfigError, ModelConfig
    from molt.models.tokenizer import apply_chat_template, render_chat

    tokenizer = build_tokenizer(ModelConfig(template_args="enable_thinking=false, style=terse"))
    tokenizer.chat_template += "{% if enable_thinking is false %}<think></think>{% endif %}{{ style }}"
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages).endswith("<think></think>terse")
    assert apply_chat_template(pickle.loads(pickle.dumps(tokenizer)), messages) == apply_chat_template(
        tokenizer, messages
    )  # an agent worker's copy renders alike
    with pytest.raises(ConfigError, match="model.template_args: 'thinking' is not KEY=VALUE"):
        ModelConfig(template_args="thinking")
    with pytest.raises(ConfigError, match="model.template_args: tokenize is an argument Molt sets"):
        ModelConfig(template_args="tokenize=true")
    assert ModelConfig(template_args="ids=[1, 2],on=true").template_kwargs() == {"ids": [1, 2], "on": True}
