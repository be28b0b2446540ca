"""The warm start's cache: keyed by every row of a data file, full fine-tuning even for a LoRA run, and a folder
that an interrupted warm start (or a full disk) left is trained again; the run's optimizer settings are in the key."""

import json
from pathlib import Path

from molt.cli.main import parse_config
from molt.cli.warm_start import warm_start


def test_warm_start_key_covers_every_row_and_ignores_lora(tmp_path, monkeypatch):
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path / "cache"))
    rows = [{"messages": [{"role": "user", "content": f"{i}+{i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
            for i in range(12)]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--data.path", str(data), "--rollout.reward", "exact", "--model.warmstart_steps", "1"]
    cfg = parse_config([*flags, "--train.lora_rank", "4", "--train.lora_alpha", "8", "--ckpt.every", "1"])
    first = Path(warm_start(cfg))
    assert not (first / "adapter").exists()  # all weights trained, not adapters
    assert not (first.parent / "checkpoints").exists()  # the run's --ckpt.every is not the cached SFT's
    rows[-1]["messages"][1]["content"] = "changed"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    second = Path(warm_start(parse_config(flags)))
    assert second != first  # the last row changed: not served stale
    (second / "config.json").unlink()  # as if interrupted before it finished
    assert Path(warm_start(parse_config(flags))) == second and (second / "config.json").exists()
    (second / "model.safetensors").write_bytes(b"truncated by a full disk")  # a corrupt cache is trained again
    assert Path(warm_start(parse_config(flags))) == second and (second / "model.safetensors").stat().st_size > 100
    third = Path(warm_start(parse_config([*flags, "--train.weight_decay", "0.1"])))  # the SFT's AdamW is the run's
    assert third != second and Path(warm_start(parse_config([*flags, "--train.lr", "1e-3"]))) == second
    # chat template options render the demonstrations otherwise: another key (left out at their default, so the
    # caches made before the setting existed stay valid)
    assert Path(warm_start(parse_config([*flags, "--model.template_args", "x=1"]))) != second
    from molt.cli.warm_start import _key_fields
    from molt.config import ModelConfig

    assert "template_args" not in _key_fields(ModelConfig(), "router_fp32", "template_args")


def test_a_run_waiting_for_anothers_warm_start_says_so(tmp_path, monkeypatch, capfd):
    """Runs sharing the cache train a warm start once; the one that waited for the other's said nothing for minutes."""
    import fcntl

    import molt.cli.warm_start as ws

    monkeypatch.setenv("MOLT_CACHE", str(tmp_path / "cache"))
    calls, flock = [], fcntl.flock

    def held_by_another_run(fd, op):  # the first try finds the lock taken; the blocking wait then gets it
        calls.append(op)
        if len(calls) == 1:
            raise BlockingIOError
        return flock(fd, op)

    monkeypatch.setattr(ws.fcntl, "flock", held_by_another_run)  # (fcntl's own: the run directory's lock passes)
    assert Path(warm_start(parse_config(["--model.warmstart_steps", "1", "--data.num_train", "8"]))).is_dir()
    assert calls[:2] == [fcntl.LOCK_EX | fcntl.LOCK_NB, fcntl.LOCK_EX]
    assert "waiting for another run's warm start of this model and data" in capfd.readouterr().err
