"""Tokenizers: local HF tokenizer folders in and out (`load_tokenizer` / `save_tokenizer`, never downloading);
Molt's built-in byte-level tokenizer with a ChatML chat template (`build_builtin_tokenizer`, built offline,
identically on every machine); and conversation -> text -> token ids (`render_chat`, `apply_chat_template`)
with the 0/1 loss mask over assistant turns, derived from the template itself (`assistant_mask`).

Knows nothing of models, engines or training; depends only on `transformers` and `tokenizers`."""

from __future__ import annotations

import itertools
import json
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

Message = Mapping[str, Any]

# Files any of which marks a folder as holding a tokenizer (fast, sentencepiece, BPE or WordPiece).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")

# Control tokens: atomic, and dropped by `decode(..., skip_special_tokens=True)`.
BUILTIN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Markup tokens: atomic but kept when decoding, so an agent still sees (and parses) its tool calls.
BUILTIN_MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
IMAGE_PLACEHOLDER = "<|image|>"  # one per image in rendered text; the VLM processor expands it
NUM_BYTE_TOKENS = 256
# Ids are fixed: byte b is id b, then the special tokens, then the markup tokens, in the order above.
BUILTIN_TOKENIZER_VOCAB_SIZE = NUM_BYTE_TOKENS + len(BUILTIN_SPECIAL_TOKENS) + len(BUILTIN_MARKUP_TOKENS)

# ChatML as Qwen2.5 renders it: an optional system turn (which also lists `tools` as JSON lines),
# assistant tool calls as `<tool_call>{json}</tool_call>`, consecutive tool results grouped into one
# user turn of `<tool_response>` blocks, and `<|im_start|>assistant\n` as the generation prompt.
# Unlike Qwen there is no default system prompt. History is never rewritten, so every rendering of
# a conversation is a prefix of the rendering of any longer one.
BUILTIN_CHAT_TEMPLATE = r"""
{%- macro render_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}{{- render_text(messages[0].content) + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call the functions below. Each one is described by a JSON signature inside '
        + '<tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments '
        + 'between <tool_call> and </tool_call>:\n<tool_call>\n'
        + '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first_is_system -%}
    {{- '<|im_start|>system\n' + render_text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' + render_text(message.content) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- set args = fn.arguments if fn.arguments is defined else {} -%}
            {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {{- (args if args is string else args | tojson) + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + render_text(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + render_text(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()


# The VLM variant (built-in tokenizer with `<|image|>`) also renders image parts as one placeholder each;
# the text template stays byte-identical so saved text tokenizers are still recognised as built-in.
BUILTIN_VLM_CHAT_TEMPLATE = BUILTIN_CHAT_TEMPLATE.replace(
    "{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}",
    "{%- if part.type == 'text' -%}{{- part.text -}}"
    "{%- elif part.type in ('image', 'image_url', 'input_image') -%}{{- '" + IMAGE_PLACEHOLDER + "' -}}{%- endif -%}",
)


class ChatTemplateError(ValueError):
    """A chat template cannot be used as asked (missing, or it rewrites history)."""


class HistoryRerendered(ChatTemplateError):
    """The template renders an earlier assistant turn otherwise once later turns follow (e.g. Qwen3 drops its
    reasoning): no one token sequence holds every turn as it was generated; train each as its own segment."""


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the HF tokenizer in local folder `path` (never downloads; errors name the path)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist or is not a directory")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"{str(folder)!r} is not a tokenizer folder: it has none of {', '.join(_TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"could not load a tokenizer from {str(folder)!r}: {exc}") from exc


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: str | Path) -> Path:
    """Write `tokenizer` as an HF folder readable by old and new `transformers` (and so by vLLM).

    The chat template goes inline into `tokenizer_config.json` (older readers look only there, not
    in `chat_template.jinja`), the class is named `PreTrainedTokenizerFast` rather than
    transformers 5's `TokenizersBackend`, and a legacy `special_tokens_map.json` is written beside it."""
    folder = Path(folder)
    tokenizer.save_pretrained(str(folder), save_jinja_files=False)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")
    special_map = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, sort_keys=True) + "\n")
    return folder


def build_builtin_tokenizer(out_dir: str | Path | None = None, image_token: bool = False) -> PreTrainedTokenizerFast:
    """Build Molt's built-in tokenizer (and save it as an HF folder in `out_dir` if given).

    Byte-level BPE with no merges: every UTF-8 byte is one token (id = byte value), so any text round-trips
    exactly and nothing is unknown; a tiny model learns bytes fine, and no merge crosses a text boundary. On
    top sit the ChatML control tokens (`<|endoftext|>` pad, `<|im_end|>` eos) and atomic tool/reasoning markup
    tokens. Built from constants only: ids are identical on every machine. `image_token` (VLMs) adds the
    special `<|image|>` placeholder as the last id; text ids are unchanged."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}  # the byte -> character map of ByteLevel
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges it cannot change the ids, and offsets stay per character.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BUILTIN_SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in BUILTIN_MARKUP_TOKENS])
    assert backend.get_vocab_size() == BUILTIN_TOKENIZER_VOCAB_SIZE
    if image_token:
        backend.add_special_tokens([AddedToken(IMAGE_PLACEHOLDER, special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=BUILTIN_VLM_CHAT_TEMPLATE if image_token else BUILTIN_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    if out_dir is not None:
        save_tokenizer(tokenizer, out_dir)
    return tokenizer


def stock_fast(tokenizer: Any, *methods: str) -> bool:
    """Whether `tokenizer` is a transformers fast tokenizer whose `methods` are the library's own (no subclass
    overrides them), so calling its Rust `backend_tokenizer` in their place gives their result."""
    kind = type(tokenizer)
    return isinstance(tokenizer, PreTrainedTokenizerFast) and all(
        getattr(kind, name, None) is getattr(PreTrainedTokenizerFast, name) for name in methods
    )


TEMPLATE_ARGS = "molt_template_args"  # the tokenizer attribute holding the run's chat template options


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """Render `messages` (and `tools`) to text with the tokenizer's chat template, given the run's template options
    (`TEMPLATE_ARGS`, set by the command that built the tokenizer: `--model.template_args`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template")
    return tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools is not None else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **getattr(tokenizer, TEMPLATE_ARGS, {}),
    )


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> list[int]:
    """Token ids of the rendered conversation (which holds every special token the template wants, BOS
    included: tokenized with `add_special_tokens=False`, so no second BOS and no EOS appended)."""
    text = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def assistant_mask(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    end_of_turn: Sequence[str] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a 0/1 mask that is 1 on what the model generates.

    For assistant message i the generated text is `render(messages[:i+1])` minus
    `render(messages[:i], add_generation_prompt=True)`, cut after the last end-of-turn token in it
    (`end_of_turn`, default the tokenizer's eos): the engine stops at that token, so it is in the
    loss, while markup the template adds after it (ChatML's "\\n") is prompt for the next turn.
    A turn with no end-of-turn token is generated in full. Raises `ChatTemplateError` when the
    template re-renders history. The text is tokenized as `apply_chat_template` does, except where a
    token straddles a span edge: there it is tokenized piece by piece, as a rollout would."""
    stops = list(end_of_turn) if end_of_turn is not None else [tokenizer.eos_token]
    text, spans = _assistant_char_spans(tokenizer, list(messages), tools, [s for s in stops if s])
    ids, regions = _encode_regions(tokenizer, text, [edge for span in spans for edge in span])
    return ids, [region % 2 for region in regions]


def _assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    stops: list[str],
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character spans the model generates in it."""

    def render(msgs: list[Message], gen: bool) -> str:
        return render_chat(tokenizer, msgs, tools=tools, add_generation_prompt=gen)

    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or message.get("weight", 1) == 0:  # weight 0: context, not trained
            continue
        if i == 0:
            raise ChatTemplateError("message 0 is an assistant turn: there is no prompt to render before it")
        prompt, turn = render(messages[:i], True), render(messages[: i + 1], False)
        if not turn.startswith(prompt):
            raise ChatTemplateError(
                f"the chat template renders assistant message {i} without its generation prompt as prefix; "
                "the generated span cannot be derived from the template"
            )
        if not full.startswith(turn):
            raise HistoryRerendered(
                f"the chat template re-renders history: messages[:{i + 1}] is not a prefix of the full "
                "conversation (e.g. earlier reasoning is dropped); split the conversation into segments "
                f"at message {i + 1} and mask each segment separately"
            )
        start = len(prompt)  # the generated text ends just after its last end-of-turn token, else with the turn
        found = [(turn.rfind(stop, start), stop) for stop in stops]
        end = max((pos + len(stop) for pos, stop in found if pos >= 0), default=len(turn))
        if end > start:
            spans.append((start, end))
    return full, spans


def _encode_regions(tokenizer: PreTrainedTokenizerBase, text: str, cuts: list[int]) -> tuple[list[int], list[int]]:
    """Tokenize `text`; per token, the number of (sorted) `cuts` at or before its first character.

    Cuts that fall inside a token (a merge across the edge) are made hard: the pieces between them are tokenized
    separately, recursively (a ChatTemplateError if the pieces' ids then decode to other text). Tokenizers without
    exact offsets (slow ones, or ones whose post-processor trims whitespace off offsets) are split at every cut."""
    if not cuts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids, [0] * len(ids)
    if _has_exact_offsets(tokenizer):
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        inside = {pos for start, end in offsets for pos in range(start + 1, end)}
        hard = sorted({cut for cut in cuts if cut in inside})
        if not hard:
            return list(encoding["input_ids"]), [bisect_right(cuts, start) for start, _ in offsets]
    else:
        hard = sorted({cut for cut in cuts if 0 < cut < len(text)})
    ids, regions = [], []
    for lo, hi in itertools.pairwise([0, *hard, len(text)]):
        piece_ids, piece_regions = _encode_regions(tokenizer, text[lo:hi], [cut - lo for cut in cuts if lo < cut < hi])
        base = bisect_right(cuts, lo)
        ids += piece_ids
        regions += [base + region for region in piece_regions]
    if tokenizer.decode(ids) != tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)):
        raise ChatTemplateError("tokenized apart at the turn edges, the pieces read as other text than the whole "
                                "(e.g. a SentencePiece tokenizer's leading '▁'): their ids would train text the "
                                "template does not render; a template whose turns end at token boundaries avoids "
                                "it")  # fmt: skip
    return ids, regions


def _has_exact_offsets(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer reports untrimmed character offsets for every token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return False
    processor = backend.post_processor
    return processor is None or b'"trim_offsets":true' not in processor.__getstate__()
