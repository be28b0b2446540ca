"""`molt eval`: on a run's checkpoint it reproduces the in-training eval of that step; pass@k and per-row results."""

import json

from conftest import TINY_RUN  # noqa: I001 - tests/conftest.py

from molt.cli.main import main, parse_config
from molt.cli.train import run_train
from molt.data.tasks import get_task
from molt.log import read_metrics

FAST = [*TINY_RUN, "--train.max_steps", "2", "--train.lr", "1e-3", "--eval.every", "2", "--eval.num_prompts", "6",
        "--eval.n_samples", "3"]  # fmt: skip


def test_molt_eval_reproduces_the_in_training_eval_of_the_checkpoint(tmp_path):
    rows = [{"prompt": r["messages"][0]["content"], "answer": r["label"]} for r in get_task("arithmetic").rows(80, 0)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = ["--data.path", str(tmp_path / "rows.jsonl"), "--rollout.reward", "math,format"]
    result = run_train(parse_config([*FAST, *data, "--log.run_dir", str(tmp_path / "run")]))
    trained = {k: v for k, v in result.history[-1].items() if k.startswith("eval/")}
    assert "eval/reward/math" in trained and "eval/pass@3" in trained

    main(["eval", str(tmp_path / "run"), "--log.run_dir", str(tmp_path / "eval")])  # its latest checkpoint
    (evaluated,) = read_metrics(tmp_path / "eval")
    assert evaluated["checkpoint"].endswith("step-2")
    assert {k: evaluated[k] for k in trained} == trained
    assert "eval/pass@2" in evaluated  # every k up to n
    results = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    assert len(results) == 6 and all(len(r["samples"]) == 3 for r in results)
    assert {"text", "reward", "correct", "rewards"} <= set(results[0]["samples"][0])
    assert results[0]["row"]["answer"] and results[0]["row"]["messages"][0]["role"] == "user"

    # greedy: all samples of a row agree
    main(["eval", str(tmp_path / "run" / "checkpoints" / "step-2"), "--eval.temperature", "0",
          "--log.run_dir", str(tmp_path / "greedy")])  # fmt: skip
    greedy = [json.loads(line) for line in (tmp_path / "greedy" / "results.jsonl").read_text().splitlines()]
    assert all(len({s["text"] for s in r["samples"]}) == 1 for r in greedy)
