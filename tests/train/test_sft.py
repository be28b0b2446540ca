"""`molt sft` end to end: it learns, writes metrics, and its checkpoint loads in `transformers`."""

import json

import pytest
import torch
import transformers

from molt.cli.build import build_model, build_tokenizer
from molt.cli.main import parse_config
from molt.cli.sft import run_sft
from molt.data.formats import DataError, read_located
from molt.data.rows import prompt_rows
from molt.log import read_metrics
from molt.models import from_pretrained


def test_sft_learns_and_checkpoint_loads_in_transformers(tmp_path):
    cfg = parse_config(
        ["--train.max_steps", "12", "--train.warmup_steps", "2", "--data.num_train", "200", "--data.num_eval", "40"]
        + ["--train.batch_size", "16", "--log.run_dir", str(tmp_path / "run")]
    )
    result = run_sft(cfg)
    assert result.eval_after["eval/loss"] < result.eval_before["eval/loss"] - 1.0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 0, **result.eval_before}  # the eval before training, as molt train logs it
    assert [m["step"] for m in lines[1:13]] == list(range(1, 13))
    assert all("train/loss" in m and "train/tokens_per_s" in m for m in lines[1:13])
    assert (tmp_path / "run" / "config.yaml").exists()

    ours = from_pretrained(result.checkpoint).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(result.checkpoint).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(result.checkpoint)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+30="}], add_generation_prompt=True, return_dict=False
    )
    ids = torch.tensor([list(ids["input_ids"] if isinstance(ids, dict) else ids)])
    with torch.no_grad():
        assert (ours(ids) - theirs(input_ids=ids).logits).abs().max() <= 1e-4


def test_a_tasks_demonstrations_evaluated_on_a_held_out_file(tmp_path):
    """`--data.eval_path` without `--data.path`: its chat rows are held out as they are (not made demonstrations)."""
    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(4)]  # fmt: skip
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--data.eval_path", str(tmp_path / "held.jsonl"), "--data.num_train", "16", "--train.max_steps", "1"]
    result = run_sft(parse_config([*flags, "--train.batch_size", "4", "--log.run_dir", str(tmp_path / "run")]))
    assert result.eval_after["eval/loss"] > 0


def test_config_file_round_trips_from_run_dir(tmp_path):
    cfg = parse_config(
        ["--train.max_steps", "1", "--train.warmup_steps", "0", "--data.num_train", "8"]
        + ["--data.num_eval", "0", "--log.run_dir", str(tmp_path / "run")]
    )
    run_sft(cfg)
    again = parse_config(["--config", str(tmp_path / "run" / "config.yaml")])
    assert again.train == cfg.train and again.data == cfg.data and again.model == cfg.model


def test_malformed_dataset_line_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n\n{"messages": [}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:3: invalid JSON"):
        prompt_rows(read_located(path), {})
    path.write_text('{"messages": [{"role": "robot", "content": "hi"}]}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:1: messages\[0\] needs a 'role'"):
        prompt_rows(read_located(path), {})
    from molt.data.rows import LocatedRow
    from molt.models import build_builtin_tokenizer
    from molt.train.sft import tokenize_rows

    row = LocatedRow(messages=[{"role": "assistant", "content": "x"}, {"role": "user", "content": "hi"}])
    row.where = "data.jsonl:4"  # a row the template cannot render: a data error naming it, not an internal one
    with pytest.raises(DataError, match=r"^data\.jsonl:4: the chat template cannot render this row: message 0"):
        tokenize_rows(build_builtin_tokenizer(), [row], 64, "data.jsonl")


def test_a_template_that_leaves_out_tool_calls_is_a_data_error_not_empty_turns():
    from molt.data.rows import LocatedRow
    from molt.models import build_builtin_tokenizer
    from molt.train.sft import tokenize_rows

    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    row = LocatedRow(messages=[{"role": "user", "content": "2+3?"}, {"role": "assistant", "tool_calls": [call]},
                               {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}])  # fmt: skip
    row.where = "calls.jsonl:2"
    tokenizer = build_builtin_tokenizer()
    assert len(tokenize_rows(tokenizer, [row], 256, "calls.jsonl")[0]) == 1  # its template renders the call
    tokenizer.chat_template = (  # SmolLM2-style: content only
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(DataError, match=r"^calls\.jsonl:2: the chat template leaves out this row's tool call 'add'"):
        tokenize_rows(tokenizer, [row], 256, "calls.jsonl")
    row["messages"][-1]["content"] = "I used add: 5"  # the name elsewhere in the row: the call's own turn lacks it
    with pytest.raises(DataError, match=r"leaves out this row's tool call 'add'"):
        tokenize_rows(tokenizer, [row], 256, "calls.jsonl")
    row["messages"] = row["messages"][1:]  # opens with the assistant's call: still a data error naming the row
    with pytest.raises(DataError, match=r"^calls\.jsonl:2: the chat template cannot render this row"):
        tokenize_rows(tokenizer, [row], 256, "calls.jsonl")


def test_a_turn_ends_where_generation_stops_and_pieces_that_read_as_other_text_are_refused():
    """A template ending turns with a token other than the tokenizer's eos (Gemma's <end_of_turn>): the loss ends at
    the engine's stop token, the markup after it is prompt. A SentencePiece tokenizer that adds '▁' to a piece cut
    at a turn edge would train other text: a data error instead."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from molt.models import build_builtin_tokenizer
    from molt.train.sft import tokenize_rows

    tokenizer = build_builtin_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (ids,), (mask,), _ = tokenize_rows(tokenizer, [row], 64, "rows", end_of_turn=["<|endoftext|>"])
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "yo<|endoftext|>"
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    sp.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    texts = ["[INST] what is it [/INST]Hello there</s>"] * 50 + ["some words here and there Hello"] * 20
    sp.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>")  # fmt: skip
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + ' [/INST]' }}"
        "{% else %}{{ m.content + eos_token }}{% endif %}{% endfor %}"
    )
    row = {"messages": [{"role": "user", "content": "what is it"}, {"role": "assistant", "content": "Hello there"}]}
    with pytest.raises(DataError, match="tokenized apart at the turn edges, the pieces read as other text"):
        tokenize_rows(tokenizer, [row], 64, "rows")


def test_lora_sft_trains_only_adapters_and_saves_merged_and_peft(tmp_path):
    flags = ["--train.max_steps", "3", "--train.warmup_steps", "0", "--data.num_train", "40", "--data.num_eval", "8"]
    flags += ["--train.batch_size", "8", "--train.lora_rank", "4", "--train.lora_targets", "q", "v"]
    cfg = parse_config([*flags, "--log.run_dir", str(tmp_path / "run")], command_name="sft")
    result = run_sft(cfg)
    assert result.eval_after["eval/loss"] < result.eval_before["eval/loss"]
    merged = from_pretrained(result.checkpoint)  # only the targeted projections moved from the initial model
    init = build_model(cfg.model, build_tokenizer(cfg.model), cfg.train.seed)
    for (name, w), w0 in zip(merged.state_dict().items(), init.state_dict().values(), strict=True):
        assert torch.equal(w, w0) != (name.endswith(("q_proj.weight", "v_proj.weight"))), name
    adapter = json.loads((tmp_path / "run" / "checkpoint" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]


def test_sft_refuses_rl_flags_and_a_used_run_dir(tmp_path, capsys):
    from molt.cli.main import main

    for flag, value in (("--critic.lr", "1"), ("--rollout.n_samples_per_prompt", "3"), ("--algo.estimator", "rloo")):
        with pytest.raises(SystemExit):
            main(["sft", flag, value, "--log.run_dir", str(tmp_path / "never")])
        group = flag[2:].split(".")[0]
        assert f"{flag[2:]}: `molt sft` does not use the {group} settings" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sft", "--ckpt.keep", "2", "--log.run_dir", str(tmp_path / "never")])
    assert "ckpt.keep: has no effect here: molt sft keeps resumable checkpoints only with" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "config.yaml").write_text("{}")
    (tmp_path / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(SystemExit):
        main(["sft", "--log.run_dir", str(tmp_path / "used")])
    assert "already holds a run" in capsys.readouterr().err


def test_sft_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path, capsys, monkeypatch):
    """`--ckpt.every 2` saves resumable checkpoints; a run stopped after step 2 and resumed logs the losses of an
    unstopped run (LoRA adapters, optimizer, schedule and the data order restored), each step once; `molt train`
    refuses to resume it."""
    from conftest import one_line, run_molt

    from molt.cli.main import main
    from molt.train.sft import SftTrainer

    flags = ["--train.max_steps", "5", "--train.warmup_steps", "1", "--data.num_train", "24", "--data.num_eval", "4"]
    flags += ["--train.batch_size", "4", "--train.lora_rank", "2", "--ckpt.every", "2"]
    main(["sft", *flags, "--log.run_dir", str(tmp_path / "whole")])
    step = SftTrainer.step

    def stop_after_two(self, batches):
        if self.version == 2:
            raise KeyboardInterrupt
        return step(self, batches)

    monkeypatch.setattr(SftTrainer, "step", stop_after_two)
    with pytest.raises(SystemExit):
        main(["sft", *flags, "--log.run_dir", str(tmp_path / "stopped")])
    monkeypatch.setattr(SftTrainer, "step", step)
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["latest", "step-2"]
    err = one_line(run_molt(capsys, "train", "--resume", str(tmp_path / "stopped")))
    assert f"is a `molt sft` run: resume it with `molt sft --resume {tmp_path / 'stopped'}`" in err
    main(["sft", "--resume", str(tmp_path / "stopped")])
    whole, resumed = (read_metrics(tmp_path / name) for name in ("whole", "stopped"))
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4, 5, 5]  # eval before, steps, eval after: each once
    for a, b in zip(whole, resumed, strict=True):
        assert {
            k: v for k, v in a.items() if "/" in k and not k.startswith(("time/", "train/tokens"))
        } == pytest.approx(
            {k: v for k, v in b.items() if "/" in k and not k.startswith(("time/", "train/tokens"))}, rel=1e-5
        )
    err = one_line(run_molt(capsys, "sft", "--resume", str(tmp_path / "stopped")))
    assert "is finished (its latest checkpoint is step 5" in err  # the last step is saved too


def test_sft_image_errors_name_the_file_and_line(tmp_path):
    from molt.train.sft import sft_rows, tokenize_rows

    path = tmp_path / "rows.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    bad = {"messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}, row["messages"][1]]}
    path.write_text("".join(json.dumps(r) + "\n" for r in [row] * 9 + [bad] + [row] * 10))
    cfg = parse_config(["--data.path", str(path), "--model.preset", "tiny-vlm"], command_name="sft")
    train, held_out, _ = sft_rows(cfg)
    model_cfg = build_model(cfg.model, build_tokenizer(cfg.model), 0).cfg
    with pytest.raises(DataError, match=r"rows\.jsonl:10: image 0: image file 'nope.png' does not exist"):
        tokenize_rows(build_tokenizer(cfg.model), held_out + train, 256, str(path), model_cfg)


def test_sft_freezes_the_router_when_asked(tmp_path):
    flags = ["--model.preset", "tiny-moe", "--train.freeze_router", "--train.max_steps", "1"]
    flags += ["--train.warmup_steps", "0", "--data.num_train", "8", "--data.num_eval", "0"]
    cfg = parse_config([*flags, "--log.run_dir", str(tmp_path / "run")], command_name="sft")
    trained = from_pretrained(run_sft(cfg).checkpoint)
    init = build_model(cfg.model, build_tokenizer(cfg.model), cfg.train.seed)
    routers = set(init.router_names())
    assert routers
    for (name, w), w0 in zip(trained.state_dict().items(), init.state_dict().values(), strict=True):
        if name in routers or name.endswith(("q_proj.weight", "gate_up_proj")):
            assert torch.equal(w, w0) == (name in routers), name


def test_a_template_that_rewrites_history_trains_each_turn_as_it_was_generated():
    """Qwen3-style: earlier turns lose their reasoning once a later turn follows. Each assistant turn becomes its
    own sample, the conversation up to it, so every turn is trained with its reasoning, as the engine generated it."""
    from molt.models import build_builtin_tokenizer
    from molt.train.sft import tokenize_rows

    tokenizer = build_builtin_tokenizer()
    tokenizer.chat_template = (
        "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' -}}"
        "{%- if m.role == 'assistant' and not loop.last -%}{{- m.content.split('</think>')[-1] -}}"
        "{%- else -%}{{- m.content -}}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    turns = [("user", "1+1?"), ("assistant", "<think>a</think>2"), ("user", "2+2?"), ("assistant", "<think>b</think>4")]
    row = {"messages": [{"role": role, "content": content} for role, content in turns]}
    ids, masks, _ = tokenize_rows(tokenizer, [row], 256, "rows")
    trained = [tokenizer.decode([t for t, m in zip(i, k, strict=True) if m]) for i, k in zip(ids, masks, strict=True)]
    assert trained == ["<think>a</think>2<|im_end|>", "<think>b</think>4<|im_end|>"]
    assert "<|im_start|>assistant\n2<|im_end|>" in tokenizer.decode(ids[1])  # the first turn as the template shows it
