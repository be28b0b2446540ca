"""Datasets on disk: every format and a column mapping load the same rows; bad rows name file and line."""

import gc
import json

import pytest

from molt.cli.main import parse_config
from molt.data.dataset import dataset_rows, file_rows
from molt.data.formats import DataError

ROWS = [{"question": f"{a}+{a}=", "solution": str(2 * a), "tests": [a, a + 1]} for a in range(20)]


def _write_all(tmp_path, rows):
    """The same rows as .jsonl, .json (array), .parquet, and `datasets` save_to_disk folders."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=2))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    parts = {"train": datasets.Dataset.from_list(rows[4:]), "test": datasets.Dataset.from_list(rows[:4])}
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "dsdict"))
    return ["rows.jsonl", "rows.json", "rows.parquet", "ds"]


def _data(*flags):
    return parse_config([*flags]).data


def test_every_format_and_a_column_mapping_load_the_same_rows(tmp_path):
    names = _write_all(tmp_path, ROWS)
    mapped = [{**r, "prompt": r["question"], "answer": r["solution"]} for r in ROWS]
    expected = [{**r, "messages": [{"role": "user", "content": r["prompt"]}]} for r in mapped]
    for name in names:
        data = _data("--data.path", str(tmp_path / name), "--data.columns", "prompt=question,answer=solution")
        assert file_rows(data.path, data) == expected, name
    # a plain `prompt` column needs no mapping; the system prompt goes first
    prompts = [{"prompt": r["question"], "answer": r["solution"]} for r in ROWS]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    data = _data("--data.path", str(tmp_path / "p.jsonl"), "--data.system_prompt", "Be brief.")
    first = file_rows(data.path, data)[0]
    assert first["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "0+0="}]
    both = {"messages": [{"role": "user", "content": "OLD"}], "question": "What is 2+2?"}
    (tmp_path / "both.jsonl").write_text(json.dumps(both) + "\n")
    data = _data("--data.path", str(tmp_path / "both.jsonl"), "--data.columns", "prompt=question")
    assert file_rows(data.path, data)[0]["messages"] == [{"role": "user", "content": "What is 2+2?"}]  # mapping wins


def _call(name: str, arguments: dict) -> dict:
    return {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


CHATS = [  # OpenAI-style tool-call turns (no content), weights on some turns, calls with other arguments per row
    {"messages": [{"role": "user", "content": "add 1 and 2"}, _call("add", {"a": 1, "b": 2}),
                  {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3", "weight": 1}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Oslo?"},
                  _call("weather", {"city": "Oslo"}), {"role": "tool", "content": "rain"},
                  {"role": "assistant", "content": "Rain.", "weight": 0}, {"role": "user", "content": "again"},
                  {"role": "assistant", "content": "Rain."}], "extra_info": {"index": 1, "hint": "umbrella"}},
]  # fmt: skip
CHATS[0]["extra_info"] = {"index": 0, "hint": None}  # a struct column keeps its nulls, as JSON rows hold them


def test_chat_rows_with_tool_calls_read_the_same_from_every_format(tmp_path):
    """Arrow gives every message the fields of all rows' messages (None where a row had none): a `weight` on a system
    turn, a `city` argument in `add`'s call; the rows read back as written, and a tool-call turn needs no content."""
    for name in _write_all(tmp_path, CHATS):
        data = _data("--data.path", str(tmp_path / name))
        assert file_rows(data.path, data) == CHATS, name


def test_held_out_split_is_seeded_shuffled_or_from_eval_path_or_test_split(tmp_path):
    _write_all(tmp_path, ROWS)
    path, cols = str(tmp_path / "rows.jsonl"), ["--data.columns", "prompt=question"]
    train, held = dataset_rows(_data("--data.path", path, "--data.num_eval", "5", *cols))
    assert len(held) == 2 and len(train) == 18  # at most 10% held out
    assert sorted(r["question"] for r in train + held) == sorted(r["question"] for r in ROWS)
    assert [r["question"] for r in held + train] != [r["question"] for r in ROWS]  # shuffled
    again = dataset_rows(_data("--data.path", path, "--data.num_eval", "5", *cols))
    assert (train, held) == again  # seeded
    other = dataset_rows(_data("--data.path", path, "--data.seed", "1", *cols))
    assert other[1] != held
    train, held = dataset_rows(_data("--data.path", path, "--data.eval_path", str(tmp_path / "rows.parquet"), *cols))
    assert len(train) == 20 and [r["question"] for r in held] == [r["question"] for r in ROWS]
    train, held = dataset_rows(_data("--data.path", str(tmp_path / "dsdict"), "--data.no_shuffle", *cols))
    assert [r["question"] for r in held] == [r["question"] for r in ROWS[:4]] and len(train) == 16


def test_bad_rows_name_the_file_and_its_own_line(tmp_path):
    good = json.dumps({"prompt": "hi", "answer": "1"})
    bot = json.dumps({"messages": [{"role": "bot", "content": "x"}]})
    cases = {
        "bad_json": (f"{good}\n\n{{oops\n", r"bad_json\.jsonl:3: invalid JSON"),
        "open_string": (
            f'{good}\n{{"prompt": "a\n',
            r"open_string\.jsonl:2: invalid JSON \(Unterminated string starting at column 12\)",
        ),
        "no_prompt": (f"{good}\n{good}\n\n\n" + json.dumps({"question": "q"}) + "\n", r"no_prompt\.jsonl:5: no prompt"),
        "bad_role": (bot + "\n", r"bad_role\.jsonl:1: messages\["),
        "not_object": (f"{good}\n[1, 2]\n", r"not_object\.jsonl:2: expected an object"),
        "twice": (f"{good}\n" + '{"prompt": "a", "prompt": "b"}\n', r"twice\.jsonl:2: .*key 'prompt' appears twice"),
        "an_array": (f"[\n{good}\n]\n", r"an_array\.jsonl:1: .*one JSON array is a \.json file"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
        with pytest.raises(DataError, match=message):
            dataset_rows(_data("--data.path", str(tmp_path / f"{name}.jsonl")))
        assert gc.isenabled()  # paused while the rows are read (2.1x faster at 300K rows), back on after an error
    (tmp_path / "array.json").write_text(f'[\n  {good},\n  {good},\n\n  {{"answer": "2"}}\n]\n')
    with pytest.raises(DataError, match=r"array\.json:5: no prompt"):
        dataset_rows(_data("--data.path", str(tmp_path / "array.json")))
    (tmp_path / "map.jsonl").write_text(f"{good}\n" + json.dumps({"answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"map\.jsonl:1: no column 'question' \(data.columns prompt=question\)"):
        dataset_rows(_data("--data.path", str(tmp_path / "map.jsonl"), "--data.columns", "prompt=question"))
    (tmp_path / "array.json").write_text(f'[{good},\n {{"prompt": "a", "meta": {{"x": 1, "x": 2}}}}]')
    with pytest.raises(DataError, match=r"array\.json:2: invalid JSON \(key 'x' appears twice"):
        dataset_rows(_data("--data.path", str(tmp_path / "array.json")))
    (tmp_path / "binary.jsonl").write_bytes(b"{}\n\x89PNG\x00\xff\xfe")
    with pytest.raises(DataError, match=r"binary\.jsonl:2: not UTF-8"):
        dataset_rows(_data("--data.path", str(tmp_path / "binary.jsonl")))


def test_a_damaged_datasets_folder_or_a_json_object_is_a_data_error_naming_the_file(tmp_path):
    _write_all(tmp_path, ROWS)
    path = lambda name: _data("--data.path", str(tmp_path / name), "--data.columns", "prompt=question")  # noqa: E731
    arrow = next((tmp_path / "ds").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:100])  # truncated
    with pytest.raises(DataError, match=rf"{arrow.name}: cannot read this `datasets` Arrow file"):
        dataset_rows(path("ds"))
    arrow.unlink()
    with pytest.raises(DataError, match=rf"{arrow.name}: cannot read this `datasets` Arrow file"):
        dataset_rows(path("ds"))
    (tmp_path / "ds" / "state.json").write_text("{oops")
    with pytest.raises(DataError, match=r"ds/state\.json: not a `datasets` index \(JSONDecodeError"):
        dataset_rows(path("ds"))
    (tmp_path / "dsdict" / "dataset_dict.json").write_text('{"split": ["train"]}')
    with pytest.raises(DataError, match=r"dataset_dict\.json: not a `datasets` index \(KeyError: no 'splits'\)"):
        dataset_rows(path("dsdict"))
    (tmp_path / "object.json").write_text(json.dumps({"data": ROWS}, indent=2))
    with pytest.raises(DataError, match=r"object\.json: one JSON object \(keys 'data'\), not rows"):
        dataset_rows(path("object.json"))


def test_config_time_errors_name_the_key(tmp_path, capsys):
    (tmp_path / "rows.csv").write_text("a,b\n")
    for flags, message in [
        (["--data.path", str(tmp_path / "rows.csv")], "unknown dataset format '.csv'"),
        (["--data.path", str(tmp_path / "missing.jsonl")], "data.path: file"),
        (["--data.columns", "prompt"], "is not TARGET=SOURCE"),
    ]:
        with pytest.raises(SystemExit):
            parse_config(flags)
        assert message in " ".join(capsys.readouterr().err.split()), flags


def test_byte_order_mark_empty_turns_and_the_split_held_out(tmp_path):
    good = json.dumps({"prompt": "hi", "answer": "1"})
    (tmp_path / "bom.jsonl").write_bytes(("\ufeff" + good + "\n").encode())
    assert (
        dataset_rows(_data("--data.path", str(tmp_path / "bom.jsonl"), "--data.num_eval", "0"))[0][0]["answer"] == "1"
    )
    for name, messages, message in [
        ("empty", [{"role": "user", "content": " "}], r"empty\.jsonl:2: messages\[0\]\.content is empty"),
        (
            "missing",
            [{"role": "user", "content": "q"}, {"role": "assistant"}],
            r"missing\.jsonl:2: messages\[1\] needs",
        ),
    ]:
        (tmp_path / f"{name}.jsonl").write_text(good + "\n" + json.dumps({"messages": messages}) + "\n")
        with pytest.raises(DataError, match=message):
            dataset_rows(_data("--data.path", str(tmp_path / f"{name}.jsonl")))
    _write_all(tmp_path, ROWS)  # dsdict: train = ROWS[4:], test = ROWS[:4]
    flags = ["--data.path", str(tmp_path / "dsdict"), "--data.split", "test", "--data.columns", "prompt=question"]
    train, held = dataset_rows(_data(*flags, "--data.num_eval", "5"))
    assert sorted(r["question"] for r in train + held) == sorted(r["question"] for r in ROWS[:4])
    assert not {r["question"] for r in held} & {r["question"] for r in train}  # never the training split itself


def test_a_chat_row_with_its_answer_prompts_rl_without_it():
    import asyncio

    from molt.agents.env import Env

    user = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 0+3?"}]
    answer = [{"role": "assistant", "content": "ANSWER3"}]
    assert asyncio.run(Env().reset({"messages": user + answer, "answer": "3"})) == user
    multi = [*user, *answer, {"role": "user", "content": "and 1+1?"}]
    assert asyncio.run(Env().reset({"messages": [*multi, *answer, *answer]})) == multi


def test_trls_prompt_completion_rows_give_the_answer_turns():
    """Standard and conversational: `molt sft` trains the completion; the RL prompt leaves it out."""
    from molt.agents.env import prompt_messages
    from molt.data.rows import prompt_row

    text = prompt_row({"prompt": "2+3?", "completion": "5"}, "pc.jsonl:1", {})
    chat = prompt_row({"prompt": [{"role": "user", "content": "2+3?"}],
                       "completion": [{"role": "assistant", "content": "5"}]}, "pc.jsonl:2", {})  # fmt: skip
    for row in (text, chat):
        assert row["messages"] == [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
        assert prompt_messages(row["messages"]) == row["messages"][:1]
    with pytest.raises(DataError, match="pc.jsonl:3: field 'completion' must be a string or a list"):
        prompt_row({"prompt": "2+3?", "completion": 5}, "pc.jsonl:3", {})


def test_a_folder_of_split_named_shards_reads_its_split_and_refuses_what_it_cannot_read(tmp_path):
    """The Hub's layout (train-00000-of-00002.parquet beside test-00000-of-00001.parquet) mixed the test rows into
    training; a .json shard, an upper-case suffix, a .jsonl.gz or a subfolder were skipped without a word."""
    from molt.data.formats import read_located

    folder = tmp_path / "data"
    folder.mkdir()
    for name, n in (("train-00000-of-00002.jsonl", 2), ("train-00001-of-00002.JSON", 1), ("test-00000.jsonl", 3)):
        rows = [{"prompt": f"{name} {i}", "answer": "1"} for i in range(n)]
        text = json.dumps(rows) if name.endswith("JSON") else "".join(json.dumps(r) + "\n" for r in rows)
        (folder / name).write_text(text)
    assert [r["prompt"] for _, r in read_located(folder)] == [
        "train-00000-of-00002.jsonl 0", "train-00000-of-00002.jsonl 1", "train-00001-of-00002.JSON 0"]  # fmt: skip
    assert len(read_located(folder, "test")) == 3
    train, held = dataset_rows(_data("--data.path", str(folder)))  # held out: the test files, as a DatasetDict's
    assert len(train) == 3 and sorted(r["messages"][0]["content"] for r in held)[0] == "test-00000.jsonl 0"
    with pytest.raises(DataError, match="named by split \\(test, train\\), none 'validation'"):
        read_located(folder, "validation")
    (folder / "more.jsonl.gz").write_bytes(b"")
    with pytest.raises(DataError, match="holds more.jsonl.gz, not .jsonl/.json/.parquet files"):
        read_located(folder)


def test_rows_a_rollout_would_fail_on_are_found_at_start_up(tmp_path):
    """A row without the answer --rollout.reward math grades against, or with half an emoji's JSON escape, failed
    its rollouts only when the loop reached it (at row 180,000 of 200,000 in the audit), after the model was built."""
    from molt.cli.inputs import load_inputs
    from molt.cli.main import parse_config

    good = json.dumps({"prompt": "1+1=", "answer": "2"})
    cases = {
        "no_answer": (json.dumps({"prompt": "2+2="}), "no_answer.jsonl:2: no 'answer' \\(or 'label'\\) column"),
        "surrogate": ('{"prompt": "hi \\ud83d", "answer": "1"}', "surrogate.jsonl:2: the text holds '\\\\ud83d'"),
    }
    for name, (row, message) in cases.items():
        (tmp_path / f"{name}.jsonl").write_text(f"{good}\n{row}\n")
        cfg = parse_config(["--data.path", str(tmp_path / f"{name}.jsonl"), "--rollout.reward", "math,format"])
        with pytest.raises(DataError, match=message):
            load_inputs(cfg)


def test_a_tasks_held_out_prompts_never_train():
    """arithmetic has 900 sums: every one of its 183 distinct held-out prompts was also among the training rows."""
    for task in ("arithmetic", "calculator"):
        train, held = dataset_rows(_data("--data.task", task))
        assert not {json.dumps(r["messages"]) for r in held} & {json.dumps(r["messages"]) for r in train}, task
        assert len(held) == 200 and len(train) > 1500
    with pytest.raises(DataError, match="data.num_train: every one of the 5 generated rows"):  # it hung, no rows
        dataset_rows(_data("--data.task", "arithmetic", "--data.num_train", "5", "--data.num_eval", "3000"))
