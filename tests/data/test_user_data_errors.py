"""Start-up errors about a run's data and reward: a dataset needs a reward or an agent; `molt.make_config` checks
the user code a config names, as the CLI does."""

import json

import pytest

import molt
from molt.cli.inputs import load_inputs
from molt.cli.main import parse_config
from molt.config import ConfigError
from molt.data.rows import prompt_row
from molt.models.vision import message_images


def test_a_dataset_without_reward_or_agent_is_a_config_error(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    with pytest.raises(ConfigError, match=r"data.path: a dataset needs --rollout.reward \(e.g. math\)"):
        load_inputs(parse_config(["--data.path", str(path)]))
    inputs = load_inputs(parse_config(["--data.path", str(path), "--rollout.reward", "math"]))
    assert len(inputs.train_rows) == 4 and inputs.reward is not None
    assert load_inputs(parse_config([])).reward is None  # a built-in task grades its own rows
    assert load_inputs(parse_config(["--data.path", str(path), "--data.task", "arithmetic"])).reward is None
    assert load_inputs(parse_config(["--data.eval_path", str(path)])).reward is None  # the task's Env grades it


def test_a_reward_on_a_built_in_tasks_rows_scores_the_final_answer_of_the_tasks_env(tmp_path):
    """The task's Env still runs the episode (the calculator's tool); on the user's rows a RewardEnv answers once."""
    from molt.agents.builtin import CalculatorEnv
    from molt.agents.reward_env import RewardEnv, ScoredEnv

    env = load_inputs(parse_config(["--rollout.reward", "math"])).make_env()
    assert isinstance(env, ScoredEnv) and isinstance(env.inner, CalculatorEnv)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    assert isinstance(load_inputs(parse_config(["--data.path", str(path), "--rollout.reward", "math"])).make_env(),
                      RewardEnv)  # fmt: skip


def test_make_config_checks_the_reward_and_agent_it_names(tmp_path):
    with pytest.raises(ConfigError, match="rollout.reward: unknown reward 'mathh'"):
        molt.make_config({"rollout.reward": "mathh"})
    with pytest.raises(ConfigError, match=r"rollout.reward: \['math'\] named twice"):
        molt.make_config(molt.make_config(), rollout={"reward": "math,math"})
    with pytest.raises(ConfigError, match="agent file .*missing.py' does not exist"):
        molt.make_config(rollout={"agent": str(tmp_path / "missing.py")})
    assert molt.make_config(rollout={"reward": "math"}).rollout.reward == "math"


def test_row_images_are_checked_at_start_up(tmp_path):
    """Each prompt image opens and verifies before any model; a bad one names the file, line and image."""
    from PIL import Image

    from molt.data.formats import DataError

    Image.new("RGB", (8, 8), (200, 0, 0)).save(tmp_path / "red.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "red.png").read_bytes()[:40])

    def inputs(images, *flags):
        rows = [{"prompt": "Colour?", "images": str(tmp_path / "red.png"), "label": "red"}] * 3
        rows.insert(1, {"prompt": "Colour?", "images": images, "label": "red"})
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        argv = ["--data.path", str(tmp_path / "rows.jsonl"), "--data.task", "shape_colour", *flags]
        return load_inputs(parse_config(argv))

    vlm = ("--model.preset", "tiny-vlm")
    rows = inputs([str(tmp_path / "red.png")], *vlm).train_rows + inputs([], *vlm).eval_rows
    assert all(len(message_images(r["messages"])) <= 1 for r in rows)  # a path string is one image, not characters
    for images, message in [
        ([str(tmp_path / "nope.png")], "image 0: image file '.*nope.png' does not exist"),
        ([str(tmp_path / "red.png"), str(tmp_path / "cut.png")], "image 1: cannot decode image bytes"),
        (["https://example.com/a.png"], "image 0: image URLs are not fetched"),
        ([7], "image 0: expected a PIL image, path, bytes or data URI, got int"),
    ]:
        with pytest.raises(DataError, match=r"rows\.jsonl:2: " + message):
            inputs(images, *vlm)
    with pytest.raises(DataError, match=r"rows\.jsonl:\d: the row has 1 image\(s\) but the model has no vision tower"):
        inputs([])
    from molt.cli.inputs import check_rows

    literal = {"messages": [{"role": "user", "content": "What does <|image|> mean?"}]}  # would render as an image
    with pytest.raises(DataError, match=r"rows\.jsonl row 0: the text holds <\|image\|> literally"):
        check_rows([literal], True, "rows.jsonl", True)
    check_rows([literal], False, "rows.jsonl", True)  # text to a text-only model
    with pytest.raises(ConfigError, match="data.task: 'shape_colour' rows hold images; model.preset 'tiny' has no"):
        molt.make_config({"data.task": "shape_colour"})
    # TRL's vision format: {"type": "image"} parts in the messages, filled from the images column in order
    red = str(tmp_path / "red.png")
    trl = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]}
    placed = prompt_row(trl | {"images": [red], "label": "red"}, "row 0", {})
    assert message_images(placed["messages"]) == [red] and trl["messages"][0]["content"][0] == {"type": "image"}
    for images, parts in (([red, red], 1), ([], 1)):  # an image without a part, a part without an image
        with pytest.raises(DataError, match=f"row 0: the images column holds {len(images)} image.s. for the {parts}"):
            prompt_row(trl | {"images": images}, "row 0", {})


def test_rows_that_would_render_an_empty_or_partial_prompt_are_errors_naming_the_line(tmp_path):
    """A content part the template does not render (it would become no text at all) and an RL prompt with no turn
    before the trailing assistant ones are data errors at start-up, not a silently empty prompt or failed rollouts."""
    from molt.data.formats import DataError

    def inputs(messages):
        good = {"messages": [{"role": "user", "content": [{"type": "text", "text": "1+1?"}]}], "answer": "2"}
        rows = [good, {"messages": messages, "answer": "2"}, good]
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load_inputs(parse_config(["--data.path", str(tmp_path / "rows.jsonl"), "--rollout.reward", "math"]))

    for content, message in [
        (["What is 1+1?"], r'content\[0\]: a content part is a dict with "type" in'),
        ([{"text": "What is 1+1?"}], r'content\[0\]: a content part is a dict with "type" in'),
        ([{"type": "input_text", "text": "1+1?"}], r'content\[0\]: a content part is a dict with "type" in'),
        ([{"type": "text", "content": "1+1?"}], r'content\[0\]: a text part needs a "text" string'),
    ]:
        with pytest.raises(DataError, match=r"rows\.jsonl:2: messages\[0\]\." + message):
            inputs([{"role": "user", "content": content}])
    weighted = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2", "weight": 2}]
    with pytest.raises(DataError, match=r"rows\.jsonl:2: messages\[1\]\.weight: 0 \(not trained\) or 1"):
        inputs(weighted)
    with pytest.raises(DataError, match=r"rows\.jsonl:2: no prompt: the row's messages are all assistant turns"):
        inputs([{"role": "assistant", "content": "2"}])
    assert len(inputs([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]).train_rows) == 3
