"""A reward function file: `molt train --data.path rows.jsonl --rollout.reward examples/reward.py:reward`.

Called once per completion with the decoded text and the dataset row (every column of it). Return a
float, or a dict of named rewards: the episode's reward is their weighted sum (weights with
`--rollout.reward_weights name=w,...`, default 1), and each is logged as `reward/<name>`. An
exception or a timeout (`--rollout.step_timeout_s`) fails that rollout only. `async def` works too.
"""

from molt.agents.rewards import extract_answer, math_reward


def reward(completion: str, row: dict) -> dict[str, float]:
    """Correct final answer (built-in math check), plus a small bonus for stating it last and briefly."""
    answer = extract_answer(completion)
    return {
        "correct": math_reward(completion, row),
        "brief": float(answer is not None and len(completion) <= 4 * len(answer) + 16),
    }
