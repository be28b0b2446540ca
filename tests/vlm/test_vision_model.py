"""The vision tower, processor and VLM checkpoints: pixels, placeholders, save/load, bad images."""

import base64
import json

import pytest
import torch
from PIL import Image
from vlm_support import IMAGE_ID, PER_IMAGE, TOK, VISION, image, png_bytes, small_vlm

from molt.models import apply_chat_template, from_pretrained, preset, save_pretrained
from molt.models.tokenizer import BUILTIN_TOKENIZER_VOCAB_SIZE, assistant_mask, build_builtin_tokenizer
from molt.models.transformer import Transformer
from molt.models.vision import (
    ImageError,
    expand_image_tokens,
    expand_row_images,
    image_data_uri,
    image_spans,
    load_image,
    pixel_hash,
    rgb_image,
    to_pixels,
)


def test_every_image_kind_gives_the_same_pixels(tmp_path):
    img = image((200, 10, 10))
    data = png_bytes(img)
    (tmp_path / "a.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    kinds = [img, data, str(tmp_path / "a.png"), uri, {"bytes": data}]
    kinds += [image_data_uri(k) for k in kinds]  # what ChatContext.messages hold
    pixels = [to_pixels(k, 16) for k in kinds]
    assert pixels[0].dtype == torch.uint8 and pixels[0].shape == (3, 16, 16)
    assert len({pixel_hash(p) for p in pixels}) == 1


def test_images_are_seen_as_a_viewer_shows_them_and_keep_their_encoding_in_uris(tmp_path):
    """EXIF orientation applied, 16-bit grey scaled to 8 bits (not clipped to white), transparency over white; a
    JPEG file's data URI is that JPEG (a PNG of the pixels would be many times larger)."""
    import numpy as np

    grey = Image.fromarray(np.full((4, 4), 40000, dtype=np.uint16))  # 16-bit: 40000 / 65535 -> 156
    assert set(to_pixels(png_bytes(grey), 4).flatten().tolist()) == {156}
    clear = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert set(to_pixels(clear, 4).flatten().tolist()) == {255}
    wide = Image.new("RGB", (8, 4), "red")
    wide.paste((0, 0, 255), (0, 0, 4, 4))  # left half blue; stored sideways with EXIF orientation 6 (rotate 90)
    exif = Image.Exif()
    exif[0x0112] = 6
    wide.rotate(90, expand=True).save(tmp_path / "turned.jpg", exif=exif, quality=100)
    upright = to_pixels(str(tmp_path / "turned.jpg"), 8)
    assert upright.shape == (3, 8, 8) and upright[2, 4, 0] > 200 and upright[0, 4, 7] > 200  # blue left, red right
    uri = image_data_uri(str(tmp_path / "turned.jpg"))
    assert (
        uri.startswith("data:image/jpeg;base64,")
        and base64.b64decode(uri.split(",")[1]) == (tmp_path / "turned.jpg").read_bytes()
    )
    assert torch.equal(to_pixels(uri, 8), upright)


def test_bad_images_are_clear_errors(tmp_path):
    with pytest.raises(ImageError, match=r"cannot decode image bytes \(15 bytes\): not an image format Pillow reads$"):
        to_pixels(b"\x89PNG not really", 16)
    with pytest.raises(ImageError, match="does not exist"):
        to_pixels(str(tmp_path / "missing.png"), 16)
    with pytest.raises(ImageError, match="malformed base64"):
        to_pixels("data:image/png;base64,@@@", 16)
    with pytest.raises(ImageError, match="expected a PIL image"):
        to_pixels(3.5, 16)
    with pytest.raises(ImageError, match="image URLs are not fetched"):
        to_pixels("https://example.com/a.png", 16)
    Image.new("1", (20000, 20000)).save(tmp_path / "bomb.png")  # ~76 KB, 400M pixels
    for verify in (False, True):
        with pytest.raises(ImageError, match=r"image of '.*bomb\.png' is too large \(Image size \(400000000 pixels\)"):
            load_image(str(tmp_path / "bomb.png"), verify=verify)
    (tmp_path / "cut.png").write_bytes(png_bytes(image((1, 2, 3)))[:60])
    with pytest.raises(ImageError, match=r"cannot decode image bytes of '.*cut\.png' \(60 bytes\)"):
        load_image(str(tmp_path / "cut.png"), verify=True)
    noise = Image.frombytes("RGB", (256, 256), bytes(range(256)) * 768)
    noise.save(tmp_path / "whole.jpg")  # PIL's verify reads no JPEG scan data: half a file passed the start-up check
    assert load_image(str(tmp_path / "whole.jpg"), verify="scan").format == "JPEG"
    (tmp_path / "cut.jpg").write_bytes((tmp_path / "whole.jpg").read_bytes()[:2000])
    with pytest.raises(ImageError, match=r"cut\.jpg' \(2000 bytes\): image file is truncated"):
        load_image(str(tmp_path / "cut.jpg"), verify="scan")
    assert load_image(str(tmp_path / "cut.jpg"), verify=True).format == "JPEG"  # a served image's sniff: no decode


def test_image_placeholders_in_an_assistant_turn_carry_no_loss():
    part = {"type": "image", "image": png_bytes(image((9, 9, 9)))}
    messages = [
        {"role": "user", "content": "draw"},
        {"role": "assistant", "content": [part, {"type": "text", "text": "ok"}]},
    ]
    ids, mask = assistant_mask(TOK, messages)
    ids, mask, pixels = expand_row_images(ids, mask, messages, small_vlm().cfg, "row")
    assert len(pixels) == 1 and ids.count(IMAGE_ID) == PER_IMAGE
    assert all(m == 0 for t, m in zip(ids, mask, strict=True) if t == IMAGE_ID) and any(mask)


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


def test_wrapped_base64_and_wide_or_float_grey_images_decode_as_a_viewer_shows_them():
    import io

    import numpy as np

    encoded = base64.b64encode(png_bytes(image((10, 200, 30)))).decode()
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))  # as MIME encoders write it
    assert torch.equal(to_pixels("data:image/png;base64," + wrapped, 8), to_pixels("data:;base64," + encoded, 8))
    wide = Image.fromarray(np.array([[0, 65535, 100000, 2**24]], dtype=np.int32), "I")  # past 16 bits: clipped
    assert np.asarray(rgb_image(wide))[0, :, 0].tolist() == [0, 255, 255, 255]
    floats = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F")  # [0, 1] grey
    assert np.asarray(rgb_image(floats))[0, :, 0].tolist() == [0, 128, 255]
    buffer = io.BytesIO()
    floats.save(buffer, format="TIFF")
    assert np.asarray(rgb_image(buffer.getvalue()))[0, :, 0].tolist() == [0, 128, 255]


def test_a_text_only_critic_beside_a_vlm_policy_is_refused_at_start_up(tmp_path):
    """It was an internal error at the first step (the critic body has no vision tower to read the pixels)."""
    from molt.cli.main import parse_config
    from molt.config import ConfigError
    from molt.train.critic import Critic
    from molt.train.precision import Precision

    folder = save_pretrained(Transformer(preset("tiny", vocab_size=len(TOK))), tmp_path / "text")
    cfg = parse_config(["--algo.estimator", "gae", "--critic.path", str(folder)])
    with pytest.raises(ConfigError, match="critic.path: the policy reads images but .*text has no vision tower"):
        Critic(small_vlm(), cfg, Precision.of("float32", "mixed", "cpu"))
