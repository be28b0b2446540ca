"""`molt sft`: supervised fine-tuning on chat rows, loss on the assistant tokens the template marks.

Samples are tokenized once (assistant spans derived from the chat template), packed into dense
rows, and trained with a global token-mean cross-entropy: each step's gradient is the gradient of
(sum of token losses) / (number of loss tokens in the step), however it is split into micro-batches.
`SftTrainer` holds the model, its optimizer and LoRA adapters, with the `save` / `load` that RL checkpoints use.
The command that assembles a run of them is `molt/cli/sft.py`."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from jinja2 import TemplateError

from molt.config import Config
from molt.data.dataset import dataset_rows, rows_digest
from molt.data.formats import DataError
from molt.data.rows import row_location
from molt.data.tasks import get_task
from molt.models import Transformer
from molt.models.tokenizer import HistoryRerendered, assistant_mask, render_chat
from molt.models.vision import ImageError, expand_row_images
from molt.train.lora import LoRA, save_policy
from molt.train.optim import build_optimizer
from molt.train.packing import PackedBatch
from molt.train.precision import Precision, clip_and_step
from molt.train.routing import freeze_routers
from molt.train.trainer import resume_optimizer


def sft_rows(cfg: Config) -> tuple[list[dict], list[dict], list]:
    """(train, eval) conversations: from `data.path` (10% held out) or the task's demonstrations; `data.eval_path`'s
    rows as they are; and the `rows_digest` of the training rows read (a task's rows, not its demonstrations: as
    `molt eval` and `molt train` digest them)."""
    train, held_out = dataset_rows(cfg.data)
    if cfg.data.path:
        return train, held_out, rows_digest(train)
    task, rng = get_task(cfg.data.task), random.Random(cfg.data.seed)

    def demo(row: dict) -> dict:
        return {"messages": task.demonstration(row, rng), "tools": row.get("tools")}

    held_out = held_out if cfg.data.eval_path else [demo(r) for r in held_out]  # drawn first, as they always were
    return [demo(r) for r in train], held_out, rows_digest(train)


def tokenize_rows(
    tokenizer, rows: list[dict], max_len: int, source: str, model_cfg=None, end_of_turn: list[str] | None = None
) -> tuple[list, list, list]:
    """Token ids, assistant masks and pixels per sample (images expanded for a VLM `model_cfg`); a turn's loss ends
    with the last of `end_of_turn` in it (default the tokenizer's eos), as generation stops there. A row is one
    sample, or, where the template renders earlier turns otherwise once later ones follow (Qwen3's reasoning), one
    per assistant turn, each as it was generated: the conversation up to it, its earlier turns as context.

    A row without targets or with an unusable image is a DataError naming the row (file:line); too-long rows one
    naming how many and the first three.
    Image placeholders never carry loss, even in an assistant turn."""
    ids, masks, pixels, too_long = [], [], [], []
    for i, row in enumerate(rows):
        where = row_location(row, f"{source} row {i}")
        for messages, (row_ids, row_mask) in _segments(tokenizer, row, end_of_turn, where):
            try:
                row_ids, row_mask, row_pixels = expand_row_images(row_ids, row_mask, messages, model_cfg, where)
            except ImageError as e:
                raise DataError(str(e)) from None
            if len(row_ids) > max_len:
                too_long.append((where, len(row_ids)))
            if not any(row_mask):
                raise DataError(f"{where}: no assistant tokens to train on (molt sft needs an assistant turn per row)")
            ids.append(row_ids)
            masks.append(row_mask)
            pixels.append(row_pixels)
    if too_long:  # all of them at once: a large dataset is mended in one pass
        named = ", ".join(f"{where} ({n} tokens)" for where, n in too_long[:3])
        more = f" and {len(too_long) - 3} more" if len(too_long) > 3 else ""
        raise DataError(f"{too_long[0][0]}: {len(too_long)} of {len(ids)} samples exceed data.max_len={max_len}: "
                        f"{named}{more}; raise --data.max_len or shorten them")  # fmt: skip
    return ids, masks, pixels


def _segments(tokenizer, row: dict, end_of_turn: list[str] | None, where: str) -> list[tuple[list[dict], tuple]]:
    """(messages, (ids, mask)) of the row as one sample, or, where the template re-renders history, of one sample
    per trained assistant turn (the conversation up to it, the other assistant turns weight 0); a DataError if the
    template cannot render it (it opens with an assistant turn, bad `tools`, ...) or leaves out a tool call."""
    messages, tools = row["messages"], row.get("tools")
    try:
        try:
            samples = [(messages, assistant_mask(tokenizer, messages, tools, end_of_turn=end_of_turn))]
        except HistoryRerendered:
            turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant" and m.get("weight", 1) != 0]
            parts = [[m if j == k or m.get("role") != "assistant" else {**m, "weight": 0} for j, m in
                      enumerate(messages[: k + 1])] for k in turns]  # fmt: skip
            samples = [(part, assistant_mask(tokenizer, part, tools, end_of_turn=end_of_turn)) for part in parts]
        name = next((n for part, _ in samples if (n := _unrendered_call(tokenizer, part, tools)) is not None), None)
    except (TemplateError, TypeError, ValueError) as e:  # ChatTemplateError is a ValueError
        raise DataError(f"{where}: the chat template cannot render this row: {e}") from None
    if name is not None:
        raise DataError(f"{where}: the chat template leaves out this row's tool call {name!r} (its assistant tokens "
                        "do not contain it), so molt sft would train the turn without it; use a template that renders "
                        "tool_calls, or write the calls into the turn's content")  # fmt: skip
    return samples


def _unrendered_call(tokenizer, messages: list[dict], tools) -> str | None:
    """The name of a tool call that its own assistant turn's rendered text does not contain (a template that ignores
    `tool_calls`, e.g. SmolLM2's), or None."""
    for i, message in enumerate(messages):
        trained = message.get("role") == "assistant" and message.get("weight", 1) != 0
        calls = message.get("tool_calls") or [] if trained else []
        names = [
            c["function"].get("name") for c in calls if isinstance(c, dict) and isinstance(c.get("function"), dict)
        ]
        if names:
            before = render_chat(tokenizer, messages[:i], tools=tools, add_generation_prompt=True)
            turn = render_chat(tokenizer, messages[: i + 1], tools=tools)[len(before) :]
            if missing := next((n for n in names if isinstance(n, str) and n not in turn), None):
                return missing
    return None


def token_losses(model: Transformer, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed masked cross-entropy, number of correct argmax predictions) of one packed batch."""
    logits = model(batch.input_ids, batch.position_ids, doc_ids_bt=batch.doc_ids, pixel_values=batch.pixel_values)
    nll = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(), reduction="none")
    mask = batch.loss_mask.flatten()
    correct = ((logits.argmax(-1).flatten() == batch.targets.flatten()).float() * mask).sum()
    return (nll * mask).sum(), correct


@torch.no_grad()
def evaluate(model: Transformer, batches: list[PackedBatch]) -> dict[str, float]:
    """Held-out loss per assistant token and next-token accuracy on those tokens."""
    model.eval()
    loss = correct = count = 0.0
    for batch in batches:
        batch_loss, batch_correct = token_losses(model, batch)
        loss += float(batch_loss)
        correct += float(batch_correct)
        count += float(batch.loss_mask.sum())
    model.train()
    return {"eval/loss": loss / max(count, 1), "eval/token_acc": correct / max(count, 1)}


def train_step(
    model, opt, schedule, batches: list[PackedBatch], grad_clip: float, precision: Precision, scaler=None
) -> dict[str, float]:
    """One optimizer step over micro-batches with a global token-mean denominator (forward in `precision`)."""
    denom = sum(float(b.loss_mask.sum()) for b in batches)
    total = 0.0
    for batch in batches:
        with precision.autocast():
            loss_sum, _ = token_losses(model, batch)
        loss = loss_sum / denom
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += float(loss_sum.detach())
    params = [p for group in opt.param_groups for p in group["params"]]  # the model's, or its LoRA adapters
    norm, finite = clip_and_step(opt, params, grad_clip, scaler)
    lr = schedule.get_last_lr()[0]
    schedule.step()
    return {
        "train/loss": total / denom,
        "train/grad_norm": float(norm),
        "train/lr": lr,
        "train/skipped": int(not finite),
    }


class SftTrainer:
    """`molt sft`'s model (its routers frozen when asked), optimizer, schedule, loss scaler and LoRA adapters; its
    `save` / `load` are the `Trainer` protocol's, so `molt sft` checkpoints and resumes as `molt train` does."""

    sharded = False

    def __init__(self, model: Transformer, cfg: Config, precision: Precision):
        tr = cfg.train
        freeze_routers(model, cfg)  # `train.freeze_router`: before the optimizer, which takes requires_grad params
        self.model, self.cfg, self.precision, self.scaler = model, cfg, precision, precision.scaler()
        self.lora = LoRA(model, tr.lora_rank, tr.lora_alpha, tr.lora_targets, tr.seed) if tr.lora_rank else None
        self.opt, self.schedule = build_optimizer(self.lora.parameters() if self.lora else model.parameters(), tr)
        self.version = self.num_skipped_steps = 0

    def step(self, batches: list[PackedBatch]) -> dict[str, float]:
        metrics = train_step(self.model, self.opt, self.schedule, batches, self.cfg.train.grad_clip, self.precision,
                             self.scaler)  # fmt: skip
        self.version += 1
        self.num_skipped_steps += metrics["train/skipped"]
        return metrics

    def save(self, folder: Path, tokenizer) -> dict:
        """The model as an HF folder (LoRA: merged, the adapters in `adapter/`); returns the training state."""
        save_policy(self.model, self.lora, folder, tokenizer, self.cfg.model.path)
        state = {"optimizer": self.opt.state_dict(), "schedule": self.schedule.state_dict(), "command": "sft"}
        state["scalers"] = {"policy": self.scaler.state_dict()} if self.scaler is not None else {}
        return state | ({"lora": self.lora.resume_state()} if self.lora is not None else {})

    def load(self, folder: Path, state: dict) -> None:
        """Restore what `save` returned (the weights come from the HF folder when the model is built), then this
        config's optimizer settings (a new --train.lr applies from the resumed step)."""
        self.opt.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        if self.scaler is not None and "policy" in state["scalers"]:
            self.scaler.load_state_dict(state["scalers"]["policy"])
        if self.lora is not None:
            self.lora.load_resume_state(state["lora"])
        resume_optimizer(self.opt, self.schedule, self.cfg.train)


def shuffled_batches(n: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of sample indices; each epoch is a fresh seeded permutation."""
    rng, order, queue = random.Random(seed), list(range(n)), []
    while True:
        while len(queue) < batch_size:
            rng.shuffle(order)
            queue += order
        yield queue[:batch_size]
        del queue[:batch_size]
