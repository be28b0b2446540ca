"""Runtime flags are checked at start-up, naming the key."""

import pytest

from molt.cli.main import parse_config


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--runtime.engines", "2"], "runtime.engines: is a Ray setting, which --runtime.backend local never reads"),
        (["--runtime.sync_chunk_mb", "8"], "runtime.sync_chunk_mb: is a Ray setting"),  # was silently ignored
        (["--runtime.gpus_per_actor", "1"], "runtime.gpus_per_actor: is a Ray setting"),
        (["--runtime.backend", "ray", "--runtime.trainer_ranks", "3", "--rollout.prompts_per_step", "2"],
         "runtime.trainer_ranks: (3) must be <= rollout.prompts_per_step"),
        (["--runtime.backend", "ray", "--runtime.engines", "0"], "runtime.engines: engines and trainer_ranks"),
        (["--runtime.collective_timeout_s", "0"], "runtime.collective_timeout_s: must be > 0"),
        (["--runtime.backend", "ray", "--runtime.cpus_per_actor", "0"], "runtime.cpus_per_actor: an actor needs some"),
        (["--runtime.backend", "ray", "--runtime.address", "garbage"], "runtime.address: 'garbage' is not HOST:PORT"),
        (["--runtime.engine_compile", "--runtime.engine", "vllm"], "runtime.engine_compile: is for runtime.engine"),
        (["--runtime.backend", "ray", "--runtime.engine", "vllm"],  # refused, never silently the torch engine
         "runtime.engine: vllm runs with --runtime.backend local only"),
    ],
)  # fmt: skip
def test_bad_runtime_flags_name_the_key(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(flags)
    assert message in " ".join(capsys.readouterr().err.split())
