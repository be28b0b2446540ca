"""`--rollout.reward` turns a prompt dataset into single-turn RL: sync, async, dict-returning and raising
reward functions each train a 3-step run of the tiny preset; failures are counted, named rewards logged."""

import json

import pytest

from molt.cli.main import parse_config
from molt.cli.train import run_train
from molt.data.tasks import get_task

FAST = [
    "--model.preset", "tiny", "--rollout.prompts_per_step", "2", "--rollout.n_samples_per_prompt", "4",
    "--rollout.max_tokens", "6", "--rollout.filters", "nonfinite", "--eval.every", "0",
    "--train.warmup_steps", "0", "--train.max_steps", "3", "--log.every", "100",
]  # fmt: skip

REWARDS = """
import asyncio

def plain(completion, row):
    return float(completion.strip() == row["answer"]) + len(completion) / 100

async def later(completion, row):
    await asyncio.sleep(0)
    return len(completion) / 10

def parts(completion, row):
    return {"exact": float(completion.strip() == row["answer"]), "length": len(completion) / 10}

def flaky(completion, row):
    if int(row["answer"]) % 2:
        raise ValueError("flaky reward")
    return 1.0

async def slow(completion, row):
    if int(row["answer"]) % 2:
        await asyncio.sleep(3600)  # past rollout.step_timeout_s: a timeout, counted as a failure
    return 1.0
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reward_runs")
    rows = [{"prompt": r["messages"][0]["content"], "answer": r["label"]} for r in get_task("arithmetic").rows(64, 0)]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "rewards.py").write_text(REWARDS)
    return folder


def _train(files, tmp_path, fn, *flags):
    cfg = parse_config([*FAST, "--data.path", str(files / "rows.jsonl"), "--rollout.reward",
                        f"{files / 'rewards.py'}:{fn}", "--log.run_dir", str(tmp_path / fn), *flags])  # fmt: skip
    return run_train(cfg)


@pytest.mark.parametrize("fn", ["plain", "later", "parts"])
def test_reward_function_trains_three_steps(files, tmp_path, fn):
    result = _train(files, tmp_path, fn, "--rollout.reward_weights", "length=0.5" if fn == "parts" else "")
    assert [m["step"] for m in result.history] == [1, 2, 3]
    assert all(m["rollout/failures"] == 0 for m in result.history)
    logged = [m for m in result.history if f"reward/{'length' if fn == 'parts' else fn}" in m]
    assert logged, result.history[-1].keys()
    if fn == "parts":  # each named reward is its own metric; the reward is their weighted sum
        assert all("reward/exact" in m for m in logged)
        assert all(m["train/reward_mean"] <= 1 + 0.5 * 0.7 for m in result.history)  # at most 6 tokens + eos


@pytest.mark.parametrize("fn", ["flaky", "slow"])
def test_raising_or_timing_out_reward_fails_only_its_rollouts(files, tmp_path, fn):
    flags = ["--rollout.max_failure_frac", "1", "--rollout.step_timeout_s", "1"]
    result = _train(files, tmp_path, fn, *flags)
    last = result.history[-1]
    assert [m["step"] for m in result.history] == [1, 2, 3]
    assert last["rollout/failures"] >= 4 and last["drop/agent_failure"] >= 4  # whole groups dropped, counted
    assert all(m["train/reward_mean"] == 1.0 for m in result.history)  # only the rows that scored were trained


def test_a_reward_that_always_fails_stops_the_run_with_its_error(files, tmp_path):
    (files / "always.py").write_text("def reward(completion, row):\n    raise KeyError('solution')\n")
    cfg = parse_config([*FAST, "--data.path", str(files / "rows.jsonl"), "--rollout.reward",
                        str(files / "always.py"), "--log.run_dir", str(tmp_path / "always")])  # fmt: skip
    with pytest.raises(RuntimeError, match="rollouts failed .* KeyError: 'solution'"):
        run_train(cfg)


def test_prompt_only_data_skips_the_warm_start_with_a_message(files, tmp_path, capsys):
    cfg = parse_config([*FAST, "--data.path", str(files / "rows.jsonl"), "--rollout.reward", "math",
                        "--model.warmstart_steps", "5", "--train.max_steps", "1",
                        "--log.run_dir", str(tmp_path / "math")])  # fmt: skip
    result = run_train(cfg)
    assert len(result.history) == 1
    assert "warm start skipped" in capsys.readouterr().err


@pytest.mark.parametrize("agent", ["openai_agent.py", "tool_agent.py"])
def test_reward_function_scores_an_agents_final_answer(tmp_path, agent):
    """With --rollout.agent as well, the reward function scores the last completion (ChatAgent or Env)."""
    from pathlib import Path

    examples = Path(__file__).parents[2] / "examples"
    task = "arithmetic" if agent == "openai_agent.py" else "calculator"
    cfg = parse_config([*FAST, "--data.task", task, "--rollout.agent", str(examples / agent), "--rollout.reward",
                        "exact,format", "--rollout.max_turns", "2", "--train.max_steps", "2", "--eval.every", "2",
                        "--eval.num_prompts", "2", "--eval.n_samples", "1", "--data.num_eval", "4",
                        "--model.warmstart_steps", "0", "--log.run_dir", str(tmp_path / "run")]
                       + (["--chat.no_render_tools"] if agent == "tool_agent.py" else []))  # fmt: skip
    result = run_train(cfg)
    last = result.history[-1]
    assert last["rollout/failures"] == 0 and last["eval/failures"] == 0
    assert {"eval/reward/exact", "eval/reward/format", "eval/reward/agent"} <= set(last)
    assert any("reward/agent" in m and "reward/exact" in m for m in result.history)


def test_a_reward_model_scores_the_completions(files, tmp_path, monkeypatch):
    """examples/reward_model.py: a local sequence-classification folder as the reward (RLHF); its score of a rollout
    is the model's output for the prompt and the completion in its chat template."""
    from pathlib import Path

    import torch
    import transformers

    from molt.agents.env import prompt_messages
    from molt.agents.reward_fn import load_reward
    from molt.models.tokenizer import build_builtin_tokenizer

    tokenizer = build_builtin_tokenizer()
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      num_labels=1, pad_token_id=tokenizer.pad_token_id,
                                      max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    rm = transformers.Qwen2ForSequenceClassification(config).eval()
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    monkeypatch.setenv("MOLT_REWARD_MODEL", str(tmp_path / "rm"))
    example = Path(__file__).parents[2] / "examples" / "reward_model.py"
    score = load_reward(f"{example}:score").parts[0].fn
    row = {"messages": [{"role": "user", "content": "12+30="}], "answer": "42"}
    text = tokenizer.apply_chat_template([*prompt_messages(row["messages"]), {"role": "assistant", "content": "42"}],
                                         tokenize=False)  # fmt: skip
    with torch.no_grad():
        expected = float(rm(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
    assert score("42", row) == pytest.approx(expected, abs=1e-5) and score("42", row) != score("41", row)
    long = {"messages": [{"role": "user", "content": "7+" * 300}]}  # over the reward model's 128 positions: cut left
    parts = [{"type": "image", "image": b"png"}, {"type": "text", "text": "What?"}]  # a VLM's prompt: text only
    image = {"messages": [{"role": "user", "content": parts}]}
    assert isinstance(score("42", image), float)
    text = tokenizer.apply_chat_template([*long["messages"], {"role": "assistant", "content": "42"}], tokenize=False)
    with torch.no_grad():  # its last 128 tokens
        tail = float(
            rm(input_ids=torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][-128:]])).logits[0, 0]
        )
    assert score("42", long) == pytest.approx(tail, abs=1e-5)
    result = run_train(parse_config([*FAST, "--data.path", str(files / "rows.jsonl"), "--rollout.reward",
                                     f"{example}:score", "--train.max_steps", "1", "--log.run_dir",
                                     str(tmp_path / "run")]))  # fmt: skip
    assert result.history[-1]["rollout/failures"] == 0 and "reward/score" in result.history[-1]
