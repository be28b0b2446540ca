"""`molt eval`: on a run's checkpoint it reproduces the in-training eval of that step; pass@k and per-row results."""

import json

import pytest
from conftest import TINY_RUN, one_line, run_molt  # noqa: I001 - tests/conftest.py

from molt.cli.main import main, parse_config
from molt.cli.train import run_train
from molt.data.tasks import get_task
from molt.log import read_metrics
from molt.models import Transformer, build_builtin_tokenizer, preset, save_pretrained

FAST = [*TINY_RUN, "--train.max_steps", "2", "--train.lr", "1e-3", "--eval.every", "2", "--eval.num_prompts", "6",
        "--eval.n_samples", "3"]  # fmt: skip


def test_molt_eval_reproduces_the_in_training_eval_of_the_checkpoint(tmp_path, capsys):
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
    import asyncio

    import molt  # the Python API: the same eval, in a script and awaited on a running loop (a notebook's)

    scripted = molt.evaluate(tmp_path / "run", log={"run_dir": str(tmp_path / "api")})
    awaited = asyncio.run(molt.evaluate_async(tmp_path / "run", log={"run_dir": str(tmp_path / "api2")}))

    async def cell():  # the blocking call inside a running loop: on a worker thread (asyncio.run refuses to nest)
        return molt.evaluate(tmp_path / "run", log={"run_dir": str(tmp_path / "api3")})

    in_loop = asyncio.run(cell())
    expected = {k: v for k, v in evaluated.items() if k != "checkpoint"}
    assert scripted.metrics == awaited.metrics == in_loop.metrics == expected
    results = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    assert len(results) == 6 and all(len(r["samples"]) == 3 for r in results)
    assert {"text", "reward", "correct", "rewards"} <= set(results[0]["samples"][0])
    assert results[0]["row"]["answer"] and results[0]["row"]["messages"][0]["role"] == "user"
    with pytest.raises(SystemExit):  # an eval into another run's folder would replace its config.yaml
        main(["eval", str(tmp_path / "run"), "--log.run_dir", str(tmp_path / "run")])
    assert read_metrics(tmp_path / "run")[-1]["step"] == 2

    # greedy: all samples of a row agree
    main(["eval", str(tmp_path / "run" / "checkpoints" / "step-2"), "--eval.temperature", "0",
          "--log.run_dir", str(tmp_path / "greedy")])  # fmt: skip
    greedy = [json.loads(line) for line in (tmp_path / "greedy" / "results.jsonl").read_text().splitlines()]
    assert all(len({s["text"] for s in r["samples"]}) == 1 for r in greedy)

    # the data file edited since: its held-out rows could be rows the policy trained on
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))
    err = one_line(run_molt(capsys, "eval", str(tmp_path / "run"), "--log.run_dir", str(tmp_path / "edited")))
    assert "data.path: the training rows are not those" in err and "--data.eval_path" in err

    # other held-out rows: the run's training file is no longer needed
    (tmp_path / "rows.jsonl").rename(tmp_path / "moved.jsonl")
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    main(["eval", str(tmp_path / "run"), "--data.eval_path", str(tmp_path / "held.jsonl"), "--eval.n_samples", "1",
          "--log.run_dir", str(tmp_path / "held")])  # fmt: skip
    held = [json.loads(line) for line in (tmp_path / "held" / "results.jsonl").read_text().splitlines()]
    assert [r["row"]["answer"] for r in held] == [r["answer"] for r in rows[:2]]


def test_failed_samples_are_shown_and_an_eval_where_all_failed_is_an_error(tmp_path, capsys, monkeypatch):
    tokenizer = build_builtin_tokenizer()
    save_pretrained(Transformer(preset("tiny", vocab_size=len(tokenizer))), tmp_path / "model", tokenizer=tokenizer)
    (tmp_path / "rows.jsonl").write_text("".join(f'{{"prompt": "say {i}", "answer": "{i}"}}\n' for i in range(30)))
    (tmp_path / "bad.py").write_text("def reward(completion, row):\n    raise ValueError('boom')\n")
    monkeypatch.chdir(tmp_path)
    flags = ["--data.path", "rows.jsonl", "--data.num_eval", "3", "--eval.n_samples", "2", "--rollout.max_tokens", "4"]
    result = run_molt(capsys, "eval", "model", *flags, "--rollout.reward", "bad.py", "--log.run_dir", "ev")
    summary, error = result.stderr.splitlines()[0], result.stderr.splitlines()[-1]
    assert result.returncode == 2 and "failures 6/6 (first: ValueError: boom [" in summary
    assert error.startswith("molt eval: error: every one of the 6 eval samples failed (first: ValueError: boom")
    assert "Traceback" in (tmp_path / "ev" / "rollout_failures.log").read_text()

    (tmp_path / "five.jsonl").write_text("".join(f'{{"prompt": "say {i}", "answer": "{i}"}}\n' for i in range(5)))
    one_line(run_molt(capsys, "eval", "model", "--data.path", "five.jsonl", "--rollout.reward", "exact"),
             "data.num_eval=200 rows, at most 10% of its rows, for eval: none of the 5 rows of five.jsonl")  # fmt: skip


def test_each_sample_gets_its_own_row_and_results_keep_dates_and_decimals(tmp_path, capsys, monkeypatch):
    import datetime
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = build_builtin_tokenizer()
    save_pretrained(Transformer(preset("tiny", vocab_size=len(tokenizer))), tmp_path / "model", tokenizer=tokenizer)
    rows = [{"prompt": f"say {i}", "answer": decimal.Decimal(f"{i}.50"), "day": datetime.date(2026, 1, 1 + i),
             "tags": ["x"]} for i in range(3)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    (tmp_path / "take.py").write_text(
        "def reward(completion, row):\n    row['tags'].append('seen')\n"
        "    return float(row.pop('answer') > 0) * len(row['tags'])\n"
    )  # 1 if alone
    monkeypatch.chdir(tmp_path)
    flags = ["--data.path", "rows.parquet", "--data.eval_path", "rows.parquet", "--eval.n_samples", "3"]
    refused = run_molt(capsys, "eval", "model", *flags, "--rollout.reward", "take.py", "--eval.output", "model")
    assert refused.returncode == 2 and "eval.output: model is a folder; name the results file" in refused.stderr
    flags += ["--eval.output", "new/folder/results.jsonl"]  # its folder is made
    result = run_molt(capsys, "eval", "model", *flags, "--rollout.max_tokens", "2", "--rollout.reward", "take.py")
    assert result.returncode == 0 and "failures" not in result.stderr  # no sample saw another's popped answer
    results = [json.loads(line) for line in (tmp_path / "new/folder/results.jsonl").open()]
    assert [(r["row"]["answer"], r["row"]["day"], r["row"]["tags"]) for r in results] == [
        (f"{i}.50", f"2026-01-0{i + 1}", ["x"]) for i in range(3)]  # fmt: skip
    assert [s["reward"] for r in results for s in r["samples"]] == [2.0] * 9  # each saw its own tags


def test_eval_of_a_run_reads_its_config_for_train_and_sft_layouts(tmp_path):
    """`molt eval RUN` or one of its checkpoints: `molt train`'s checkpoints/STEP and `molt sft`'s checkpoint/ both
    take the run's config.yaml (its data), never the built-in task's defaults."""
    from molt.cli.main import _eval_args

    for run, checkpoint in (("train", "checkpoints/step-2"), ("sft", "checkpoint")):
        (tmp_path / run / checkpoint).mkdir(parents=True)
        (tmp_path / run / "config.yaml").write_text("data:\n  path: rows.jsonl\n")
        for target in (tmp_path / run, tmp_path / run / checkpoint):
            assert _eval_args(str(target), [])[:2] == ["--config", str(tmp_path / run / "config.yaml")], target
    (tmp_path / "model").mkdir()
    assert _eval_args(str(tmp_path / "model"), []) == ["--model.path", str(tmp_path / "model")]


def test_eval_of_a_run_whose_teacher_and_critic_folders_are_gone(tmp_path):
    """`molt eval RUN` reads the run's data, rollout and eval settings, not its algo or critic ones: a teacher or
    critic folder deleted since the run does not stop it (it checks none of what eval does not use)."""
    from molt.cli.main import parse_command

    tokenizer = build_builtin_tokenizer()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-1"
    arch = preset("tiny", vocab_size=len(tokenizer), max_position_embeddings=8192)
    save_pretrained(Transformer(arch), checkpoint, tokenizer=tokenizer)
    (checkpoint.parent / "latest").write_text("step-1")
    gone = str(tmp_path / "gone")
    (tmp_path / "run" / "config.yaml").write_text(
        f"algo:\n  estimator: on_policy_distill\n  teacher: {gone}\ncritic:\n  path: {gone}\neval:\n  n_samples: 3\n"
    )
    cfg = parse_command(["eval", str(tmp_path / "run")])
    assert cfg.eval.n_samples == 3 and cfg.algo.teacher == "" and cfg.critic.path == ""
    # a Ray run's config, of a long-context run: a file that passes is read whole (engine sizing included)
    ray = "runtime:\n  backend: ray\n  engines: 2\n  trainer_ranks: 2\n"
    long = "rollout:\n  max_len: 6000\n  max_in_flight: 8\ntrain:\n  micro_batch_tokens: 8192\n"
    (tmp_path / "run" / "config.yaml").write_text(f"model:\n  path: {checkpoint}\n{ray}{long}")  # its base model
    cfg = parse_command(["eval", str(tmp_path / "run")])
    assert (cfg.rollout.max_len, cfg.rollout.max_in_flight, cfg.runtime.engines) == (6000, 8, 2)
    # both: only the gone folder is left out (not the run's micro-batch, which its max_len is checked against)
    (tmp_path / "run" / "config.yaml").write_text(f"model:\n  path: {checkpoint}\n{long}algo:\n  teacher: {gone}\n")
    cfg = parse_command(["eval", str(tmp_path / "run")])
    assert (cfg.rollout.max_len, cfg.algo.teacher) == (6000, "")
