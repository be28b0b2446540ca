"""The vision tower, processor and VLM checkpoints: pixels, placeholders, save/load, bad images."""

import base64
import json

import pytest
import torch
from vlm_support import IMAGE_ID, PER_IMAGE, TOK, VISION, image, png_bytes, small_vlm

from molt.models import apply_chat_template, from_pretrained, preset, save_pretrained
from molt.models.tokenizer import BUILTIN_TOKENIZER_VOCAB_SIZE, build_builtin_tokenizer
from molt.models.transformer import Transformer
from molt.models.vision import ImageError, expand_image_tokens, image_spans, pixel_hash, to_pixels


def test_every_image_kind_gives_the_same_pixels(tmp_path):
    img = image((200, 10, 10))
    data = png_bytes(img)
    (tmp_path / "a.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    kinds = [img, data, str(tmp_path / "a.png"), uri, {"bytes": data}]
    pixels = [to_pixels(k, 16) for k in kinds]
    assert pixels[0].dtype == torch.uint8 and pixels[0].shape == (3, 16, 16)
    assert len({pixel_hash(p) for p in pixels}) == 1


def test_bad_images_are_clear_errors(tmp_path):
    with pytest.raises(ImageError, match="cannot decode image bytes"):
        to_pixels(b"\x89PNG not really", 16)
    with pytest.raises(ImageError, match="does not exist"):
        to_pixels(str(tmp_path / "missing.png"), 16)
    with pytest.raises(ImageError, match="malformed base64"):
        to_pixels("data:image/png;base64,@@@", 16)
    with pytest.raises(ImageError, match="expected a PIL image"):
        to_pixels(3.5, 16)


def test_placeholders_expand_to_whole_images():
    text_tok = build_builtin_tokenizer()
    assert len(text_tok) == BUILTIN_TOKENIZER_VOCAB_SIZE and len(TOK) == BUILTIN_TOKENIZER_VOCAB_SIZE + 1
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}, {"type": "image"}]}]
    ids = apply_chat_template(TOK, messages, add_generation_prompt=True)
    assert ids.count(IMAGE_ID) == 2
    expanded, starts = expand_image_tokens(ids, IMAGE_ID, PER_IMAGE)
    assert image_spans(expanded, IMAGE_ID, PER_IMAGE) == starts and len(expanded) == len(ids) + 2 * (PER_IMAGE - 1)
    with pytest.raises(ImageError, match="not a multiple"):
        image_spans(expanded[:-1] if expanded[-1] == IMAGE_ID else expanded[: starts[1] + 1], IMAGE_ID, PER_IMAGE)


def test_images_change_the_logits_only_through_placeholders():
    model = small_vlm()
    ids = torch.tensor([[5, 6] + [IMAGE_ID] * PER_IMAGE + [7, 8]])
    red, blue = to_pixels(image((250, 0, 0)), 16)[None], to_pixels(image((0, 0, 250)), 16)[None]
    a, b = model(ids, pixel_values=red), model(ids, pixel_values=blue)
    assert torch.equal(a[:, :2], b[:, :2]) and not torch.allclose(a[:, -1], b[:, -1])
    with pytest.raises(ValueError, match="4 image placeholder tokens but 0"):
        model(ids)


def test_vlm_folder_round_trips_and_text_folders_stay_as_before(tmp_path):
    model = small_vlm()
    folder = save_pretrained(model, tmp_path / "vlm", tokenizer=TOK)
    hf = json.loads((folder / "config.json").read_text())
    assert hf["vision_config"]["image_size"] == VISION.image_size and hf["image_token_id"] == IMAGE_ID
    loaded = from_pretrained(folder)
    ids = torch.tensor([[1] + [IMAGE_ID] * PER_IMAGE + [2]])
    pixels = to_pixels(image((0, 200, 0)), 16)[None]
    assert torch.equal(loaded(ids, pixel_values=pixels), model(ids, pixel_values=pixels))
    text = Transformer(preset("tiny", vocab_size=300, hidden_size=64, num_layers=1)).init_weights()
    text_hf = json.loads((save_pretrained(text, tmp_path / "text") / "config.json").read_text())
    assert "vision_config" not in text_hf and from_pretrained(tmp_path / "text").vision is None
