"""`molt train` with a VLM: bad image rows stop it at start-up, images over the budget drop their rollouts; the visual
task learns."""

import base64
import json

import pytest

from molt import cache_root
from molt.cli.main import parse_config
from molt.cli.train import run_train
from molt.data.formats import DataError
from molt.data.tasks import get_task

pytestmark = pytest.mark.slow
FAST = ["--runtime.threads", "1", "--runtime.engine_threads", "1"]  # 2 shared cores: one OpenMP pool each


def test_bad_image_rows_stop_at_start_up_and_images_over_the_budget_are_dropped(tmp_path):
    good = get_task("shape_colour").rows(4, seed=1)
    image = good[0]["messages"][0]["content"][0]["image"]

    def row(*images):
        content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": "Colour?"}]
        return {"messages": [{"role": "user", "content": content}], "label": "red"}

    def train(*rows):
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = parse_config(["--data.task", "shape_colour", "--data.path", str(tmp_path / "rows.jsonl"),
                            "--model.preset", "tiny-vlm", "--model.warmstart_steps", "0", "--train.max_steps", "2",
                            "--train.warmup_steps", "1", "--rollout.prompts_per_step", "2",
                            "--rollout.n_samples_per_prompt", "2", "--rollout.filters", "nonfinite",
                            "--rollout.max_failure_frac", "1", "--rollout.max_tokens", "4", "--eval.every", "0",
                            "--log.run_dir", str(tmp_path / "run"), *FAST])  # fmt: skip
        return run_train(cfg)

    junk = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
    with pytest.raises(DataError, match=r"rows\.jsonl:1: image 0: cannot decode image bytes"):
        train(row(junk), *good)
    with pytest.raises(DataError, match=r"rows\.jsonl:1: image 0: image file '.*missing.png' does not exist"):
        train(row(str(tmp_path / "missing.png")), *good)
    assert not (tmp_path / "run").exists()
    result = train(row(*[image] * 12), row(*[image] * 12), *good)
    last = result.history[-1]
    assert last["drop/image_over_context"] >= 2, last  # whole groups
    assert all(m["train/num_samples"] == 4 for m in result.history)
    assert result.history[0]["train/logprob_diff"] < 1e-5  # on-policy step: the trainer saw the engine's inputs


def test_tiny_vlm_learns_shape_colour(tmp_path, monkeypatch):
    (tmp_path / "cache").mkdir()  # the warm start (SFT) runs in the test; the machine's compiled kernels are reused
    (cache_root() / "kernels").mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / "kernels").symlink_to(cache_root() / "kernels", target_is_directory=True)
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path / "cache"))
    cfg = parse_config(["--data.task", "shape_colour", "--model.preset", "tiny-vlm", "--model.warmstart_steps", "60",
                        "--train.max_steps", "30", "--eval.every", "30", "--eval.num_prompts", "64",
                        "--log.run_dir", str(tmp_path / "run"), *FAST])  # fmt: skip
    result = run_train(cfg)
    before, after = result.eval_before["eval/reward_mean"], result.eval_after["eval/reward_mean"]
    assert after >= before + 0.15, (before, after)
