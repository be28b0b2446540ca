"""The config tree and its CLI: flags, files, overrides, and clear errors."""

import importlib.metadata
import socket

import pytest
from conftest import small_model  # noqa: I001 - tests/conftest.py

from molt.cli.config_file import load_config_file
from molt.cli.main import main, parse_command, parse_config
from molt.config import Config, ConfigError
from molt.models import save_pretrained


def test_flags_set_fields():
    cfg = parse_config(["--train.lr", "3e-4", "--model.preset", "small", "--train.betas", "0.8", "0.9"])
    assert cfg.train.lr == 3e-4 and cfg.model.preset == "small" and cfg.train.betas == (0.8, 0.9)


def test_boolean_flags_take_a_config_file_word():
    from molt.cli.main import parse_command

    cfg = parse_command(["train", "--rollout.dump", "true", "--train.share_prefix=False"])
    assert cfg.rollout.dump and not cfg.train.share_prefix
    assert not parse_command(["train", "--train.share_prefix", "off"]).train.share_prefix
    whiten = [parse_command(["train", "--algo.whiten", word]).algo.whiten for word in ("false", "yes", "None")]
    assert whiten == [False, True, None]  # bool | None: 'false' was refused ("Expected one of True, False, None")
    assert not parse_command(["train", "--rollout.dump", "--rollout.dump", "0"]).rollout.dump  # the last one wins
    assert parse_config(["--data.task", "arithmetic", "--rollout.dump", "yes"]).rollout.dump


def test_file_then_flags_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlr = 5e-4\nmax_steps = 70\n\n[data]\nmax_len = 128\n")
    cfg = parse_config(["--config", str(path), "--train.lr", "1e-5"])
    assert cfg.train.lr == 1e-5  # flag wins
    assert cfg.train.max_steps == 70 and cfg.data.max_len == 128  # file applies
    assert cfg.train.batch_size == Config().train.batch_size  # untouched default


def test_a_flag_changes_a_valid_file_and_mends_a_bad_one(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[rollout]\nmax_len = 3000\n[train]\nmicro_batch_tokens = 3000\n")
    cfg = parse_config(["--config", str(path), "--train.micro_batch_tokens", "16384"])  # not checked with its default
    assert (cfg.train.micro_batch_tokens, cfg.rollout.max_len) == (16384, 3000)
    path.write_text("[train]\nlr = -1.0\nmax_steps = 7\n")
    cfg = parse_config(["--config", str(path), "--train.lr", "1e-4"])
    assert (cfg.train.lr, cfg.train.max_steps) == (1e-4, 7)
    with pytest.raises(ConfigError, match=r"run\.toml:2: train\.lr: "):
        parse_config(["--config", str(path), "--train.max_steps", "9"])


def test_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 2.0e-4\n  betas: [0.9, 0.99]\nmodel:\n  preset: tiny-moe\n")
    cfg = load_config_file(Config, path)
    assert cfg.train.lr == 2e-4 and cfg.train.betas == (0.9, 0.99) and cfg.model.preset == "tiny-moe"


def test_unknown_key_in_file_names_key_file_and_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlr = 5e-4\nlrr = 1.0\n")
    with pytest.raises(ConfigError, match=r"run\.toml:3: train\.lrr: unknown key; did you mean 'train\.lr'"):
        load_config_file(Config, path)


def test_unknown_group_in_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1.0e-3\ntrian:\n  lr: 1\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:3: trian: unknown key; did you mean 'train'"):
        load_config_file(Config, path)
    path.write_text('rollout:\n  filters: [score-range]\n  score_range: [0.5, "1"]\n')  # a tuple's entry: its line
    with pytest.raises(ConfigError, match=r"run\.yaml:3: rollout\.score_range\[1\]: expected float, got str"):
        load_config_file(Config, path)


def test_a_config_key_in_a_file_is_refused_with_its_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('# a run\nconfig = "other.toml"\n[train]\nlr = 5e-4\n')
    with pytest.raises(ConfigError, match=r"run\.toml:2: config: a config cannot name another config; pass the file"):
        load_config_file(Config, path)
    path.write_text('config = ""\n')  # as older runs' config.yaml hold it: names nothing
    assert load_config_file(Config, path) == Config()
    path.write_text("confi = 1\n")
    with pytest.raises(ConfigError, match=r"confi: unknown key; valid keys: \[.*'chat'\]$"):  # `config` not offered
        load_config_file(Config, path)


def test_wrong_type_in_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nmax_steps = "ten"\n')
    with pytest.raises(ConfigError, match=r"run\.toml:2: train\.max_steps: expected int, got str 'ten'"):
        load_config_file(Config, path)


def test_bool_is_not_an_int(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nmax_steps = true\n")
    with pytest.raises(ConfigError, match="train.max_steps: expected int"):
        load_config_file(Config, path)


def test_wrong_type_flag_exits_with_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["sft", "--train.lr", "fast"])
    assert exit_info.value.code == 2
    assert "--train.lr" in capsys.readouterr().err


def test_unknown_flag_exits(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--train.lrr", "1"])
    assert "train.lrr" in capsys.readouterr().err


def test_invalid_value_and_combination(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--train.lr=-1"])
    assert "train.lr: must be > 0" in capsys.readouterr().err
    path = tmp_path / "run.toml"
    path.write_text("[train]\nmicro_batch_tokens = 64\n[data]\nmax_len = 128\n[rollout]\nmax_len = 32\n")
    with pytest.raises(ConfigError, match=r"train\.micro_batch_tokens: \(64\) must be >= data\.max_len"):
        load_config_file(Config, path)


def test_literal_choice_checked(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\ndtype = "float8"\n')
    with pytest.raises(ConfigError, match=r"model\.dtype: must be one of \['auto', 'float32', 'bfloat16', 'float16'\]"):
        load_config_file(Config, path)


def test_help_lists_commands_and_fields(capsys):
    main(["--help"])
    assert "sft" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    out = capsys.readouterr().out
    assert "--train.lr" in out and "Peak learning rate" in out
    main(["--version"])  # the installed package's version, which setuptools reads from molt.__version__
    assert capsys.readouterr().out == f"molt {importlib.metadata.version('molt')}\n"


def test_impossible_rl_combination(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[rollout]\nmax_len = 2048\n[train]\nmicro_batch_tokens = 1024\n")
    with pytest.raises(ConfigError, match=r"train\.micro_batch_tokens: \(1024\) must be >= rollout\.max_len \(2048\)"):
        parse_command(["train", "--config", str(path)])  # RL training's (molt sft and eval need no such micro-batch)
    path.write_text('[algo]\nestimator = "grpoo"\n')
    with pytest.raises(ConfigError, match=r"run\.toml:2: algo\.estimator: unknown; choose one of"):
        load_config_file(Config, path)
    path.write_text('[algo]\nis_level = "geo"\nis_mode = "clip"\n')
    with pytest.raises(ConfigError, match=r"algo\.is_mode: --algo\.is_level geo takes only mode mask .* not 'clip'"):
        load_config_file(Config, path)


def test_a_run_directory_as_model_path_is_its_latest_checkpoint(tmp_path):
    """`--model.path RUN_DIR` means the run's latest checkpoint for every command (train loads it, eval and serve
    score or serve it); a plain model folder stays as given."""
    run = tmp_path / "run"
    for step in ("step-1", "step-2"):
        save_pretrained(small_model(), run / "checkpoints" / step)
    (run / "checkpoints" / "latest").write_text("step-2")
    assert parse_config(["--model.path", str(run)]).model.path == str(run / "checkpoints" / "step-2")
    folder = str(run / "checkpoints" / "step-1")
    assert parse_config(["--model.path", folder]).model.path == folder


def test_yaml_duplicate_key_is_an_error_with_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_steps: 2\n  lr: 5.0e-3\ntrain:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"run.yaml:4: cannot parse: duplicate key 'train'"):
        load_config_file(Config, path)


def test_a_flag_replaces_a_file_value_unchecked_and_run_files_hold_absolute_paths(tmp_path, monkeypatch):
    """A bad path in the file is not an error when a flag sets it again; config.yaml paths work from anywhere."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "r.py").write_text("def fn(completion, row):\n    return 1.0\n")
    (tmp_path / "run.toml").write_text('[data]\npath = "gone.jsonl"\n\n[train]\nmax_steps = 5\n')
    with pytest.raises(ConfigError, match="run.toml:2: data.path: file 'gone.jsonl' does not exist"):
        parse_config(["--config", "run.toml"])
    cfg = parse_config(["--config", "run.toml", "--data.path", "rows.jsonl", "--rollout.reward", "math, r.py:fn"])
    assert cfg.data.path == "rows.jsonl" and cfg.train.max_steps == 5
    saved = cfg.file_form()
    assert saved["data"]["path"] == str(tmp_path / "rows.jsonl")
    assert saved["rollout"]["reward"] == f"math,{tmp_path / 'r.py'}:fn" and saved["ckpt"]["resume"] == ""
    cfg = parse_config(["--config", "run.toml", "--data.path", "rows.jsonl", "--train.max_steps", "100"])
    assert cfg.train.warmup_steps == 10  # the default, not clamped to the file's max_steps


def test_ineffective_filter_on_and_is_band_name_their_key(capsys):
    for flags, key in (
        (["--rollout.filters", "--rollout.filter_on", "score"], "rollout.filter_on: has no effect without filters"),
        (["--algo.is_low", "2"], "algo.is_low: the IS band needs 0 <= is_low <= 1 <= is_high"),
        (["--critic.lr", "1e-4"], "critic.lr: has no effect: no critic runs with algo.estimator grpo"),
    ):
        with pytest.raises(SystemExit):
            parse_config(flags)
        assert key in capsys.readouterr().err


def test_runtime_settings_that_cannot_act_here_are_refused_naming_their_key(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec  # vLLM passes as installed: its own refusals are the config's

    def installed(name, *args):
        return object() if name == "vllm" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", installed)
    for flags, message in (
        (["--runtime.kv_gb", "1"], "runtime.kv_gb: sets the paged cache"),
        (["--runtime.no_cuda_graphs"], "runtime.cuda_graphs: acts on CUDA only"),
        (["--runtime.kv_memory_fraction", "0.9"], "runtime.kv_memory_fraction: acts on CUDA only"),
        (["--runtime.kv_cache", "paged", "--runtime.engine_compile"], "runtime.engine_compile: compiles the slot"),
        (["--runtime.kv_cache", "slot", "--runtime.kv_gb", "1"], "runtime.kv_gb: sets the paged cache"),
        (["--runtime.engine_restarts", "-1"], "runtime.engine_restarts: must be >= 0"),
        (["--runtime.backend", "ray", "--runtime.num_cpus", "-3"], "runtime.num_cpus: must be >= 0"),
        (["--runtime.backend", "ray", "--runtime.engines", "2", "--runtime.num_cpus", "2"], "= 3, or the actors"),
        (["--model.preset", "tiny-moe", "--runtime.kv_cache", "paged"], "runtime.kv_cache: paged serves dense"),
        (["--data.max_len", "5000"], "data.max_len: (5000) is over the model's context (4096 positions"),
        (["--rollout.max_len", "5000"], "rollout.max_len: (5000) is over the model's context"),
        (["--model.preset", "tiny-vlm", "--runtime.backend", "ray"], "runtime.backend: Ray engine replicas do not"),
        (["--model.preset", "tiny-vlm", "--runtime.engine", "vllm"], "runtime.engine: vllm does not take images"),
        (["--model.no_router_fp32"], "model.router_fp32: needs a mixture-of-experts model"),
        (["--model.preset", "tiny-moe", "--algo.routing_replay", "--runtime.engine", "vllm"], "the vllm engine does"),
    ):
        with pytest.raises(SystemExit):
            parse_config(flags)
        assert message in capsys.readouterr().err, flags
    assert parse_config(["--runtime.kv_cache", "paged", "--runtime.kv_gb", "0.5"]).runtime.kv_gb == 0.5


def test_an_unreachable_ray_address_is_a_config_error(monkeypatch):
    import ray

    from molt.runtime.cluster import connect

    if not ray.is_initialized():  # `auto` with no cluster to find
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        auto = parse_config(["--runtime.backend", "ray", "--runtime.address", "auto"])
        with pytest.raises(ConfigError, match="runtime.address: auto: Could not find any running Ray instance"):
            connect(auto.runtime)

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = parse_config(["--runtime.backend", "ray", "--runtime.address", f"127.0.0.1:{port}"])
    with pytest.raises(ConfigError, match=f"runtime.address: cannot reach 127.0.0.1:{port}"):
        connect(cfg.runtime)


def test_sft_names_the_refused_flag_before_other_checks_and_run_stops_are_not_bugs(capsys, monkeypatch):
    import molt.cli.main as cli
    from molt.errors import RunFatalError

    with pytest.raises(SystemExit):
        main(["sft", "--critic.lr", "1e-3", "--rollout.max_tokens", "32"])  # max_tokens 32 is the default
    assert "critic.lr: `molt sft` does not use the critic settings" in capsys.readouterr().err
    for command, flag in [("eval", "--algo.kl_coef"), ("serve", "--data.path"), ("serve", "--log.run_dir")]:
        with pytest.raises(SystemExit):
            main([command, "model", flag, "x"])
        group = flag[2:].split(".")[0]
        assert f"{flag[2:]}: `molt {command}` does not use the {group} settings" in capsys.readouterr().err
    for command, flag in [("eval", "--runtime.backend"), ("eval", "--rollout.dump"), ("eval", "--train.lr"),
                          ("serve", "--rollout.max_turns"), ("serve", "--train.lr")]:  # fmt: skip
        with pytest.raises(SystemExit):  # RL-only settings of groups the command reads in part
            main([command, "model", flag, "1"])
        assert f"{flag[2:]}: `molt {command}` does not use this setting" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # nor does its --help list them
        main(["sft", "--help"])
    shown = capsys.readouterr().out
    assert "--train.lr" in shown and "--model.path" in shown and "--rollout." not in shown and "--algo." not in shown

    def stopped(cfg):
        raise RunFatalError("engine replica 0 died and was not restarted")

    monkeypatch.setitem(cli.COMMANDS, "train", stopped)
    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "run stopped: RunFatalError: engine replica 0 died" in err
    assert "bug in Molt" not in err and "Traceback" not in err


def test_a_reward_error_from_a_config_file_names_its_file_and_line(tmp_path, monkeypatch, capsys):
    from molt.cli.main import parse_command

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "rw.toml").write_text('[rollout]\nreward = "math"\nreward_weights = "math=1,fmt=0.1"\n')
    with pytest.raises(ConfigError, match=r"^rw.toml:3: rollout.reward_weights: \['fmt'\] name no reward"):
        parse_command(["train", "--config", "rw.toml", "--data.path", "rows.jsonl"])
    with pytest.raises(ConfigError, match=r"^rollout.reward_weights: "):  # set by the flag: no file line
        parse_command(["train", "--config", "rw.toml", "--data.path", "rows.jsonl", "--rollout.reward_weights", "x=1"])
    (tmp_path / "gae.toml").write_text('[algo]\nestimator = "gae"\n[critic]\nlr = 0.0001\n')  # as a resumed run's
    with pytest.raises(SystemExit):  # the flag makes the file's key fail its check: the file's line is named
        parse_command(["train", "--config", "gae.toml", "--algo.estimator", "grpo"])
    assert "config error: gae.toml:4: critic.lr: has no effect" in capsys.readouterr().err


def test_bad_values_and_config_files_are_one_line_naming_the_key(tmp_path, capsys, monkeypatch):
    import molt

    for flags, message in [
        (["--data.task", "nope"], "data.task: unknown task; built-in tasks: ['arithmetic'"),
        (["--rollout.top_k", "-5"], "rollout.top_k: must be >= 0"),
        (["--rollout.temperature", "inf"], "rollout.temperature: must be a finite number"),
        (["--eval.temperature", "inf"], "eval.temperature: must be a finite number"),
        (["--model.init_std", "inf"], "model.init_std: must be a finite number"),
        (["--model.warmstart_lr", "-1"], "model.warmstart_lr: must be > 0"),
        (["--train.seed", str(2**70)], "train.seed: must fit in 64 bits"),
        (["--config", str(tmp_path)], f"--config: '{tmp_path}' is a folder; give its .toml/.yaml file"),
        (["--config", "a.toml", "--config=b.toml"], "--config: given 2 times (a.toml, b.toml)"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["train", *flags])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and "config error: " + message in err and "\n" not in err, (flags, err)
    (tmp_path / "latin1.toml").write_bytes(b'[data]\nsystem_prompt = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="latin1.toml: not UTF-8 text"):
        parse_config(["--config", str(tmp_path / "latin1.toml")])
    with pytest.raises(ConfigError, match="train: a config group"):
        molt.make_config({"train": 3, "train.lr": 1e-3})
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="MOLT_CACHE=.*: not a folder"):
        molt.cache_root()


def test_the_context_bound_follows_rope_scaling():
    from molt.models.config import TransformerConfig

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert TransformerConfig(max_position_embeddings=32768, rope_scaling=yarn).context_length() == 131072
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert TransformerConfig(max_position_embeddings=131072, rope_scaling=llama3).context_length() == 131072
    assert TransformerConfig(max_position_embeddings=4096).context_length() == 4096


def test_rl_only_checks_run_for_molt_train_and_name_the_files_line(tmp_path, capsys):
    """`molt serve --rollout.temperature 0` (greedy serving) was refused 'for RL'; molt train still refuses it. A
    check of molt train's run (train.batch_size is sft's) names the config file's line, as the groups' checks do."""
    from molt.cli.main import main, parse_command

    assert parse_config(["--rollout.temperature", "0"]).rollout.temperature == 0  # the config serve builds on
    with pytest.raises(ConfigError, match="rollout.temperature: must be >= 1e-4 for RL"):
        parse_command(["train", "--rollout.temperature", "0"])
    (tmp_path / "sft.yaml").write_text("train:\n  batch_size: 8\n")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(tmp_path / "sft.yaml")])
    assert "sft.yaml:2: train.batch_size: has no effect here" in capsys.readouterr().err


def test_a_leading_tilde_is_the_home_folder_in_files_and_dicts_too(tmp_path):
    """A shell expands `~` in flags only: a config file's `log.run_dir: ~/runs/x` was written to `./~/runs/x`."""
    import os

    from molt import make_config

    (tmp_path / "run.yaml").write_text("log:\n  run_dir: ~/runs/x\neval:\n  output: ~/out.jsonl\n")
    cfg = make_config(str(tmp_path / "run.yaml"))
    assert (cfg.log.run_dir, cfg.eval.output) == (os.path.expanduser("~/runs/x"), os.path.expanduser("~/out.jsonl"))
    assert make_config({"rollout.replay": ""}).rollout.replay == ""


def test_a_typo_in_a_group_the_command_does_not_read_is_still_an_unknown_key(tmp_path, capsys):
    """A config file shared by molt train and molt sft: `algo.estimatr` passed molt sft silently (the algo group is
    skipped there), to fail only when the file reached molt train."""
    from molt.cli.main import main

    (tmp_path / "shared.yaml").write_text("algo:\n  estimatr: grpo\n")
    with pytest.raises(SystemExit):
        main(["sft", "--config", str(tmp_path / "shared.yaml")])
    assert "shared.yaml:2: algo.estimatr: unknown key; did you mean 'algo.estimator'?" in capsys.readouterr().err


def test_a_config_file_with_a_bom_or_an_upper_case_suffix_reads(tmp_path):
    """Windows editors start a file with a byte-order mark ('Invalid statement (at line 1, column 1)'), and name it
    RUN.TOML ('must end in .toml')."""
    from molt import make_config

    (tmp_path / "RUN.TOML").write_bytes(b"\xef\xbb\xbf[train]\nmax_steps = 3\n")
    (tmp_path / "run.YAML").write_bytes(b"\xef\xbb\xbftrain:\n  max_steps: 4\n")
    assert make_config(str(tmp_path / "RUN.TOML")).train.max_steps == 3
    assert make_config(str(tmp_path / "run.YAML")).train.max_steps == 4


def test_w_and_b_and_data_file_flags_are_refused_where_inert_but_a_file_may_hold_them(tmp_path):
    """`--log.wandb_mode offline` without a project, `--data.no_shuffle` on a task's rows: refused as flags; a run's
    config.yaml records every setting, so the same values in a file (an older run's) still load."""
    from molt.cli.main import parse_command

    for flag in (["--log.wandb_mode", "offline"], ["--data.no_shuffle"]):
        with pytest.raises(ConfigError, match="has no effect here"):
            parse_command(["train", *flag])
    (tmp_path / "old.yaml").write_text("log:\n  wandb_mode: offline\ndata:\n  shuffle: false\n")
    cfg = parse_command(["train", "--config", str(tmp_path / "old.yaml")])
    assert cfg.log.wandb_mode == "offline" and not cfg.data.shuffle


def test_only_rl_training_ties_micro_batches_to_rollout_max_len():
    """`molt sft` refused --train.micro_batch_tokens below rollout.max_len, a setting it refuses as a flag."""
    from molt.cli.main import parse_command
    from molt.config import ConfigError

    flags = ["--data.max_len", "128", "--train.micro_batch_tokens", "160"]
    parse_command(["sft", *flags])
    with pytest.raises(ConfigError, match=r"micro_batch_tokens: \(160\) must be >= rollout.max_len \(192\)"):
        parse_command(["train", *flags, "--rollout.max_len", "192"])
