"""Issue 23: every user mistake is one line out of the real CLI (exit code 2, no traceback), found before any
model is built; the run-time rows (context budget, step timeout, tiny eval split) say what happened.

Each test runs the CLI's entry point (`molt.cli.main.main`) in process, in a fresh folder with its own
`MOLT_CACHE`, so a warm start or a run directory written by mistake would show; one test runs the real
`python -m molt.cli.main` in a subprocess. Runs that get as far as training keep the machine's cache, so they
do not rebuild the CPU kernels (nothing is warm-started: `--model.warmstart_steps 0`).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import Ran, one_line, run_molt  # noqa: I001 - tests/conftest.py

from molt import cache_root
from molt.cli.main import main, parse_config
from molt.config import ConfigError

FAST = [
    "--model.warmstart_steps", "0", "--rollout.prompts_per_step", "1", "--rollout.n_samples_per_prompt", "4",
    "--rollout.max_tokens", "4", "--rollout.max_turns", "1", "--train.max_steps", "1", "--runtime.threads", "1",
    "--data.num_train", "16", "--data.num_eval", "4", "--eval.every", "0",
]  # fmt: skip
FROM_FOLDER = FAST[2:]  # a model folder is not warm-started: --model.warmstart_steps is refused beside it


@pytest.fixture
def molt(tmp_path, monkeypatch, capsys):
    """`molt(*args)`: `molt ARGS` in process, in `tmp_path` (cwd) with an empty cache there (`shared_cache=True`:
    the machine's, for runs that train)."""
    machine_cache = str(cache_root())
    monkeypatch.chdir(tmp_path)

    def run(*args: str, shared_cache: bool = False) -> Ran:
        monkeypatch.setenv("MOLT_CACHE", machine_cache if shared_cache else str(tmp_path / "cache"))
        return run_molt(capsys, *args)

    return run


def nothing_built(tmp_path: Path) -> None:
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_malformed_jsonl_line_out_of_the_real_executable(tmp_path):
    """End to end: the `molt` process itself exits with code 2 and prints the one line."""
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": \n')
    env = {**os.environ, "MOLT_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "molt.cli.main", "train", "--data.path", "rows.jsonl", "--rollout.reward", "exact"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    one_line(result, "molt train: data error: rows.jsonl:2: invalid JSON")
    nothing_built(tmp_path)


def test_row_without_messages(tmp_path, molt):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1"}\n\n{"question": "2+2"}\n')
    result = molt("sft", "--data.path", "rows.jsonl")
    one_line(result, "data error: rows.jsonl:3: no prompt: a row needs a 'messages' list or a 'prompt' string")
    nothing_built(tmp_path)  # found before the run directory and the model


def test_missing_agent_file_stops_before_the_warm_start(tmp_path, molt):
    result = molt("train", "--rollout.agent", "nothere.py")
    one_line(result, "molt train: config error: rollout.agent: agent file 'nothere.py' does not exist")
    nothing_built(tmp_path)


def test_agent_file_that_fails_to_import_names_its_line(tmp_path, molt):
    (tmp_path / "agent.py").write_text("from molt.agents import Env\n\nimport not_a_module_xyz\n")
    result = molt("train", "--rollout.agent", "agent.py")
    one_line(result, "rollout.agent: importing 'agent.py' failed at ", "agent.py:3: ModuleNotFoundError")
    (tmp_path / "half.py").write_text("from molt.agents import Env\n\nclass Half(Env):\n    pass\n")
    one_line(molt("train", "--rollout.agent", "half.py"), "Half does not define `async def step(...)`")
    env = "from molt.agents import Env, Result\n\nclass A(Env):\n    {}\n\n    async def step(self{}):\n        pass\n"
    (tmp_path / "sync_reset.py").write_text(env.format("def reset(self, row):\n        return 'hi'", ", action"))
    one_line(molt("train", "--rollout.agent", "sync_reset.py"), "A.reset must be `async def reset(self, row)`")
    (tmp_path / "no_action.py").write_text(env.format("x = 1", ""))
    one_line(molt("train", "--rollout.agent", "no_action.py"), "A.step must take one argument: `step(self, action)`")
    nothing_built(tmp_path)


def test_missing_checkpoint(tmp_path, molt):
    one_line(molt("train", "--resume", "runs/nope"), "ckpt.resume: run directory 'runs/nope' does not exist")
    run = tmp_path / "runs" / "killed"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("train:\n  max_steps: 4\n")
    result = molt("train", "--resume", "runs/killed")
    one_line(result, "ckpt.resume: runs/killed has no completed checkpoint (no checkpoints/latest)")
    (run / "checkpoint").mkdir()  # as `molt sft` writes
    one_line(molt("train", "--resume", "runs/killed"), "runs/killed is a `molt sft` run", "--model.path runs/killed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu(molt):
    result = molt("train", "--runtime.device", "cuda")
    one_line(result, "config error: runtime.device: 'cuda' but CUDA is not available here", "--runtime.device cpu")


def test_port_in_use(molt):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = molt("serve", "--chat.port", port)
    one_line(result, f"chat.port: cannot listen on 127.0.0.1:{port}", "--chat.port")
    # a host this machine does not have: at start-up, naming chat.host (it was an internal error once the model and
    # engine were built, or 'port in use' with a port given)
    one_line(molt("serve", "--chat.host", "nohost.invalid"), "chat.host: cannot listen on 'nohost.invalid'")


def test_model_path_that_is_not_a_model_folder(tmp_path, molt):
    import json

    from molt.models import Transformer, build_builtin_tokenizer, preset, save_pretrained

    (tmp_path / "weights").mkdir()
    one_line(molt("train", "--model.path", "weights"), "model.path: 'weights' is not a model folder")
    (tmp_path / "weights/model.gguf").write_bytes(b"GGUF")
    one_line(molt("train", "--model.path", "weights/model.gguf"), "is a GGUF file: convert it", "convert_gguf(")
    one_line(molt("train", "--model.path", "weights"), "'weights' holds a GGUF file: convert it", "convert_gguf(")
    tokenizer = build_builtin_tokenizer()
    save_pretrained(Transformer(preset("tiny", vocab_size=len(tokenizer))), tmp_path / "m", tokenizer=tokenizer)
    config = json.loads((tmp_path / "m/tokenizer_config.json").read_text())
    (tmp_path / "m/tokenizer_config.json").write_text(json.dumps(config | {"chat_template": None}))
    one_line(
        molt("sft", "--model.path", "m"), "model.path: the tokenizer of m has no chat template", "--model.tokenizer"
    )


def test_an_unwritable_run_dir_or_truncated_weights_are_one_line(tmp_path, molt):
    (tmp_path / "afile").write_text("")  # a folder that cannot be made (as a read-only one cannot be written)
    one_line(molt("train", *FAST, "--log.run_dir", "afile/run", shared_cache=True),
             "config error: log.run_dir: cannot write the run directory afile/run: Not a directory")  # fmt: skip
    from molt.models import Transformer, build_builtin_tokenizer, preset, save_pretrained

    tokenizer = build_builtin_tokenizer()
    save_pretrained(Transformer(preset("tiny", vocab_size=len(tokenizer))), tmp_path / "m", tokenizer=tokenizer)
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    one_line(
        molt("train", *FROM_FOLDER, "--model.path", "m"), "model.safetensors: cannot read these weights", "truncated"
    )


def test_too_long_row_names_the_file_line(tmp_path, molt):
    short, long = (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
        ('{"messages": [{"role": "user", "content": "%s"}, {"role": "assistant", "content": "yo"}]}' % ("x" * 300)),
    )
    (tmp_path / "chats.jsonl").write_text("\n".join([short] * 2 + [long] * 5) + "\n")
    flags = ("--data.path", "chats.jsonl", "--data.no_shuffle", "--data.num_eval", "0", "--log.run_dir", "run")
    err = one_line(molt("sft", *flags), "chats.jsonl:3: 5 of 7 samples exceed data.max_len=256: chats.jsonl:3 (")
    assert "chats.jsonl:5 (" in err and "and 2 more; raise --data.max_len" in err  # all at once, the first named
    assert not (tmp_path / "run").exists()  # found before the run directory is written


def test_any_max_steps_works_with_the_default_warmup():
    from molt.train.optim import lr_factor

    assert parse_config(["--train.max_steps", "4"]).train.warmup_steps == 10  # as given: the schedule clamps it
    assert [lr_factor(step, 10, 4, 0.1) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_the_last_step_trains_at_the_final_learning_rate():
    from molt.train.optim import lr_factor

    # warm-up 2 steps, then cosine from 1 down to min_lr_ratio at step max_steps - 1: 1, 0.775, 0.325, 0.1
    factors = [lr_factor(step, 2, 6, 0.1) for step in range(6)]
    assert factors == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.325, 0.1])
    assert lr_factor(0, 0, 1, 0.1) == 1.0  # a one-step run trains at the peak


def test_prompt_over_the_context_budget_is_named_not_blamed_on_the_policy(molt):
    result = molt("train", *FAST, "--rollout.max_len", "8", shared_cache=True)
    err = one_line(result, "run stopped:", "(prompt_over_context (last: the prompt is", "rollout.max_len is 8")
    assert "raise --rollout.max_len" in err and "policy" not in err


def test_a_dropped_prompt_or_a_failed_rollout_names_its_data_row(tmp_path, molt, caplog):
    rows = ['{"prompt": "say 1", "answer": "1"}', '{"prompt": "%s", "answer": "2"}' % ("long " * 40)]
    rows.append('{"prompt": "say 3"}')  # no answer: the reward below fails on it (`exact` refuses it at start-up)
    (tmp_path / "two.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "r.py").write_text("def reward(completion, row):\n    return float(completion == row['answer'])\n")
    flags = ["--data.path", "two.jsonl", "--rollout.reward", "r.py:reward", "--rollout.max_len", "96"]
    flags += ["--rollout.max_failure_frac", "1"]
    done = molt("train", *FAST, *flags, "--rollout.filters", "nonfinite", "--train.max_steps", "2", shared_cache=True)
    assert " rollouts failed (see " in done.stderr  # the closing summary counts them
    drops = [m for m in caplog.messages if "its group is dropped (prompt_over_context)" in m]
    assert len(drops) == 1 and drops[0].startswith("two.jsonl:2: the prompt is"), drops
    failed = [m for m in caplog.messages if ") failed: KeyError" in m]
    assert failed and all("two.jsonl:3) failed: KeyError" in m for m in failed), failed


def test_step_timeout_says_what_timed_out(tmp_path, molt, caplog):
    (tmp_path / "slow.py").write_text(
        "import asyncio\nfrom molt.agents import Env, Result\n\n\nclass SlowEnv(Env):\n"
        "    async def step(self, action):\n        await asyncio.sleep(30)\n        return Result(reward=1.0)\n"
    )
    flags = ["--rollout.agent", "slow.py", "--rollout.step_timeout_s", "0.01", "--rollout.max_failure_frac", "0"]
    result = molt("train", *FAST, *flags, "--log.run_dir", "run", shared_cache=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("molt train: run stopped: ") and "rollouts failed" in last
    assert "last error: TimeoutError: SlowEnv.step did not finish within 0.01s (rollout.step_timeout_s)" in last
    # each failure is one warning line (stderr outside pytest) with the rollout id
    failures = [m for m in caplog.messages if "failed: TimeoutError: SlowEnv.step" in m]
    assert failures and all(m.startswith("rollout ") and "\n" not in m for m in failures)
    assert "Traceback" in (tmp_path / "run" / "rollout_failures.log").read_text()  # the full one, in the run dir


def test_eval_with_no_samples_or_no_held_out_rows(tmp_path, molt, caplog):
    one_line(molt("train", "--eval.n_samples", "0"), "config error: eval.n_samples: must be > 0")
    (tmp_path / "five.jsonl").write_text("".join(f'{{"prompt": "say {i}", "answer": "{i}"}}\n' for i in range(5)))
    flags = ["--data.path", "five.jsonl", "--rollout.reward", "exact", "--eval.every", "1", "--log.run_dir", "run"]
    flags += ["--rollout.filters", "nonfinite"]  # a random policy rarely varies its reward
    result = molt("train", *FAST, *flags, shared_cache=True)
    assert result.returncode == 0, result.stderr
    assert any("eval skipped: no held-out rows" in m for m in caplog.messages)  # a warning: stderr outside pytest
    assert "ZeroDivisionError" not in result.stderr + caplog.text


def test_distillation_without_a_teacher(molt):
    result = molt("train", "--algo.estimator", "on_policy_distill")
    one_line(result, "config error: algo.teacher:", "--algo.teacher")


def test_teacher_and_critic_folders_are_checked_at_start_up(tmp_path, molt):
    """Not a model folder, or a model with another tokenizer: one line naming the flag, nothing built."""
    from molt.models import Transformer, build_builtin_tokenizer, preset, save_pretrained

    tokenizer = build_builtin_tokenizer()
    tokenizer.add_tokens(["<other>"])  # one token more than the policy's built-in tokenizer
    model = Transformer(preset("tiny", vocab_size=len(tokenizer)))
    save_pretrained(model, tmp_path / "other", tokenizer=tokenizer)
    (tmp_path / "empty").mkdir()
    one_line(molt("train", *FAST, "--algo.teacher", "empty"), "config error: algo.teacher: 'empty' is not a model")
    one_line(molt("train", *FAST, "--algo.estimator", "gae", "--critic.path", "empty"), "critic.path: 'empty'")
    result = molt("train", *FAST, "--algo.teacher", "other", shared_cache=True)
    sizes = f"({len(tokenizer)} vs {len(tokenizer) - 1} tokens)"
    one_line(result, f"config error: algo.teacher: other's tokenizer is not the policy's {sizes}")
    policy = build_builtin_tokenizer()  # the policy's tokenizer, on a model with too few vocabulary rows
    save_pretrained(Transformer(preset("tiny", vocab_size=len(policy) - 8)), tmp_path / "small", tokenizer=policy)
    result = molt("train", *FAST, "--algo.estimator", "gae", "--critic.path", "small", shared_cache=True)
    one_line(
        result, f"config error: critic.path: small's model has {len(policy) - 8} vocabulary rows for {len(policy)}"
    )
    result = molt("train", *FAST, "--train.batch_size", "4")  # before the warm start (this cache is empty)
    one_line(result, "config error: train.batch_size: has no effect here: it is molt sft's batch")
    one_line(molt("train", *FROM_FOLDER, "--model.path", "small"), f"the tokenizer has {len(policy)} tokens, more than")
    assert not (tmp_path / "runs").exists()


def test_env_and_result_import_from_molt_agents(tmp_path):
    code = "from molt.agents import Env, Result, ChatAgent; print(Result(reward=1.0).reward)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "1.0", result.stderr


def test_yaml_exponent_floats(tmp_path):
    (tmp_path / "run.yaml").write_text("train:\n  lr: 5e-4\n  min_lr_ratio: 1E-1\n  max_steps: 4\n")
    cfg = parse_config(["--config", str(tmp_path / "run.yaml")])
    assert cfg.train.lr == 5e-4 and cfg.train.min_lr_ratio == 0.1 and cfg.train.max_steps == 4


def test_batch_size_help_says_it_is_sft_only(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--train.batch_size INT `molt sft` only" in help_text


def test_a_bug_in_molt_prints_its_traceback_and_user_errors_do_with_the_env_var(monkeypatch, capsys):
    from molt.cli import main as cli
    from molt.config import ConfigError

    def broken(cfg):
        raise KeyError("oops")

    monkeypatch.setitem(cli.COMMANDS, "train", broken)
    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" in err and "internal error: KeyError" in err

    def mistaken(cfg):
        raise ConfigError("data.path: not there")

    monkeypatch.setitem(cli.COMMANDS, "train", mistaken)
    monkeypatch.setenv("MOLT_TRACEBACK", "1")
    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" in err
    assert err.strip().splitlines()[-1] == "molt train: config error: data.path: not there"

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "train", interrupted)  # Ctrl-C: one line, exit code 130, no traceback
    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 130 and "Traceback" not in err and err.startswith("molt train: interrupted")

    def terminated(cfg):
        os.kill(os.getpid(), signal.SIGTERM)  # as `timeout`, Slurm or Kubernetes stop a run
        time.sleep(5)

    monkeypatch.setitem(cli.COMMANDS, "train", terminated)
    on_term = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 143 and err.startswith("molt train: terminated (SIGTERM)"), err
    assert signal.getsignal(signal.SIGTERM) is on_term  # main() leaves the handler as it found it


def test_chat_flags_are_refused_where_no_chat_agent_runs(tmp_path, monkeypatch):
    from molt.cli.inputs import check_user_code
    from molt.cli.main import _flag_keys, parse_command
    from molt.config import ConfigError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the agent files' folder goes on it: restored afterwards
    body = "\n\nclass {}:\n    async def {}(self, x):\n        pass\n"
    (tmp_path / "my_env.py").write_text("from molt.agents import Env" + body.format("MyEnv(Env)", "step"))
    (tmp_path / "my_chat.py").write_text("from molt.agents.chat import ChatAgent" + body.format("C(ChatAgent)", "run"))
    for agent, what in [(["--rollout.agent", "my_env.py"], "the agent MyEnv is an Env"), ([], "no --rollout.agent")]:
        args = [*agent, "--chat.no_render_tools"]
        with pytest.raises(ConfigError, match=f"^chat.no_render_tools: has no effect here: {what}"):
            check_user_code(parse_config(args), _flag_keys(args))
    args = ["--rollout.agent", "my_chat.py", "--chat.no_render_tools"]
    check_user_code(parse_config(args), _flag_keys(args))  # a ChatAgent's chat server uses them
    (tmp_path / "shared.yaml").write_text("chat:\n  render_tools: false\n")  # a file's chat settings: not refused
    check_user_code(parse_config(["--config", "shared.yaml"]), _flag_keys(["--config", "shared.yaml"]))
    with pytest.raises(ConfigError, match="^chat.no_render_tools: has no effect here"):  # as `molt train` checks
        parse_command(["train", "--rollout.agent", "my_env.py", "--chat.no_render_tools"])


def test_help_names_resume_and_a_reader_that_stops_early_is_no_error(tmp_path):
    cmd = [sys.executable, "-m", "molt.cli.main", "train", "--help"]
    full = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert full.returncode == 0 and "--resume RUN_DIR" in full.stdout and "--replay RUN_DIR" in full.stdout
    with subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as head:
        head.stdout.read(10)  # `molt train --help | head -c 10`: the help's later writes find no reader
        head.stdout.close()
        head.wait(timeout=120)
        assert b"Traceback" not in (error := head.stderr.read()) and b"internal error" not in error


def test_yaml_dotted_keys_and_the_lora_alpha_key(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("train.lr: 5e-4\ntrain:\n  max_steps: 3\n")
    cfg = parse_config(["--config", str(tmp_path / "run.yaml")])
    assert (cfg.train.lr, cfg.train.max_steps) == (5e-4, 3)  # as TOML's `train.lr = 5e-4`
    (tmp_path / "twice.yaml").write_text("train.lr: 5e-4\ntrain:\n  lr: 3.0\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: train.lr: set twice"):
        parse_config(["--config", str(tmp_path / "twice.yaml")])
    with pytest.raises(SystemExit):
        parse_config(["--train.lora_alpha", "0"])
    assert "train.lora_alpha: must be > 0" in capsys.readouterr().err


def test_serve_fits_its_default_context_to_a_shorter_model(tmp_path):
    """A 512-position model is served at 512 (it failed at start-up unless --chat.max_len was lowered); a max_len the
    user sets over the context is still refused."""
    import asyncio

    from molt.cli.main import parse_command
    from molt.cli.serve import build_server
    from molt.models import Transformer, preset, save_pretrained
    from molt.models.tokenizer import build_builtin_tokenizer

    tokenizer = build_builtin_tokenizer()
    arch = preset("tiny", vocab_size=len(tokenizer), max_position_embeddings=512)
    save_pretrained(Transformer(arch), tmp_path / "model", tokenizer=tokenizer)
    server = build_server(parse_command(["serve", str(tmp_path / "model"), "--chat.port", "0"]))
    assert server.serve_max_len == 512
    asyncio.run(server.engine.close())
    with pytest.raises(ConfigError, match=r"chat.max_len: \(1000\) is over the model's context \(512 positions"):
        build_server(parse_command(["serve", str(tmp_path / "model"), "--chat.port", "0", "--chat.max_len", "1000"]))


def test_a_context_over_the_model_or_a_kv_cache_over_the_memory_is_one_line(molt):
    one_line(molt("serve", "--chat.max_len", "200000", "--chat.port", "0"),
             "config error: chat.max_len: (200000) is over the model's context (4096 positions")  # fmt: skip
    from molt.models import preset
    from molt.runtime.factory import check_slot_memory

    sizing, needs = {"num_slots": 4096, "max_seq_len": 1_000_001}, {}
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ConfigError, match=r"rollout.max_len: the engine's KV cache of 4096 sequences") as e:
            check_slot_memory(preset("tiny", vocab_size=300), sizing, "rollout.max_len", dtype)
        needs[dtype] = float(re.search(r"needs ([\d.]+) GB", str(e.value))[1])
    assert needs[torch.bfloat16] == pytest.approx(needs[torch.float32] / 2, rel=1e-3)  # the cache is in its dtype


def test_a_write_the_machine_refuses_is_one_line_naming_the_file(monkeypatch, capsys):
    """A full disk, a file-size limit, a folder made read-only, moved or deleted under the run: the machine's doing,
    not a bug in Molt (it printed 'internal error' and a traceback)."""
    from molt.cli import main as cli

    def disk_full(cfg):
        raise OSError(28, "No space left on device", "runs/x/metrics.jsonl")

    monkeypatch.setitem(cli.COMMANDS, "train", disk_full)
    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert err.strip() == "molt train: cannot go on: runs/x/metrics.jsonl: No space left on device"

    def timed_out(cfg):
        raise TimeoutError  # an OSError, but not storage: Molt's own

    monkeypatch.setitem(cli.COMMANDS, "train", timed_out)
    with pytest.raises(SystemExit):
        main(["train"])
    assert "internal error: TimeoutError" in capsys.readouterr().err


PLUGIN = """import torch
from molt import algo


@algo.POLICY_LOSSES.register("nan-loss")
def nan_loss(logp_bt, old_logp_bt, advantages_bt, mask_bt, params):
    return -advantages_bt * logp_bt * float("nan"), {}


@algo.POLICY_LOSSES.register("index-loss")
def index_loss(logp_bt, old_logp_bt, advantages_bt, mask_bt, params):
    return helper(logp_bt), {}


def helper(logp_bt):
    return logp_bt[999]
"""


def test_a_failure_of_your_own_variant_is_a_user_error_naming_its_flag_and_file(tmp_path, molt, monkeypatch):
    """A plugin's policy loss returning NaN (refused by Molt's check) or raising in its own code was "internal error
    ... a bug in Molt"; now one line, exit code 2, naming the variant, its flag and the plugin's file and line. The
    same check failing for a built-in variant stays Molt's bug."""
    from molt.algo import POLICY_LOSSES

    (tmp_path / "rw.py").write_text("def fn(completion, row):\n    return len(set(completion)) / 10\n")
    (tmp_path / "plugin.py").write_text(PLUGIN)
    run = ("train", *FAST, "--rollout.reward", "rw.py:fn", "--algo.plugins", "plugin.py")
    try:
        nan = molt(*run, "--algo.policy_loss", "nan-loss", shared_cache=True)
        where = f"(--algo.policy_loss nan-loss); it is defined at {tmp_path / 'plugin.py'}:5"
        line = one_line(nan, "error in your variant: policy loss 'nan-loss' returned NaN or inf on", where)
        assert "bug in Molt" not in line
        raised = molt(*run, "--algo.policy_loss", "index-loss", shared_cache=True)
        one_line(raised, "policy loss 'index-loss' (--algo.policy_loss index-loss, defined at ", "plugin.py:10) raised "
                 f"IndexError at {tmp_path / 'plugin.py'}:16: index 999 is out of bounds")  # fmt: skip
    finally:
        for name in ("nan-loss", "index-loss"):
            POLICY_LOSSES._fns.pop(name, None), POLICY_LOSSES._info.pop(name, None)
        sys.modules.pop("molt_agent_plugin", None), sys.modules.pop("plugin", None)
    from molt.cli import main as cli

    def built_in_fails(cfg):
        raise POLICY_LOSSES.problem("ppo", "returned NaN or inf on 3 action tokens")

    monkeypatch.setitem(cli.COMMANDS, "train", built_in_fails)
    built_in = molt("train")
    assert built_in.returncode == 1 and "internal error" in built_in.stderr and "bug in Molt" in built_in.stderr
