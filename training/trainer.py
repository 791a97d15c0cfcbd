"""One training loop for every task: bucketed batches, AdamW with warm-up and decay, gradient clipping,
evaluation on dev each epoch, best-checkpoint keeping, resume, progress with tokens/s and ETA, metrics
to JSONL, and DistributedDataParallel when started under torchrun (gloo on CPU, nccl on GPU).

A task supplies the model and four things: the training lengths, a collate function, a loss, and an
evaluation that returns a dict with a "score" (higher is better) used to keep the best checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from training.batching import bucketed_batches, to_device


class Task(Protocol):
    model: nn.Module

    def train_lengths(self) -> list[int]: ...

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]: ...

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]: ...

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]: ...  # on the model's device


@dataclass
class TrainConfig:
    out_dir: str
    epochs: int = 3
    max_steps: int = 0  # when > 0, stop after this many optimizer steps
    schedule_steps: int = 0  # when > 0, the learning-rate schedule's length (runs cut short keep a longer run's rates)
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup_steps: int = 300
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0
    max_tokens: int = 8192  # padded tokens per batch (per process)
    max_batch: int = 128
    seed: int = 1234
    threads: int = 0  # torch intra-op threads; 0 leaves the default
    save_every: int = 500  # steps between mid-epoch checkpoints (for resume)
    eval_every: int = 0  # when > 0, also evaluate on dev every this many steps (pretraining curves)
    keep_checkpoints: int = 0  # when > 0, also keep the weights of the last N save_every steps (for averaging)
    resume: bool = False
    device: str = "cpu"  # where the model trains ("cuda" on a lent GPU machine); batches are built on the CPU


def load_trained(checkpoint: Path, model_class: type[nn.Module]) -> tuple[nn.Module, dict]:
    """A checkpoint written by train() -> (model in eval mode, the whole saved dict)."""
    from model import ModelConfig

    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    model = model_class(ModelConfig(**saved["model_config"]))
    model.load_state_dict(saved["model"])
    return model.eval(), saved


def load_pretrained_encoder(model: nn.Module, checkpoint: Path) -> dict:
    """Copy a pretrained checkpoint's `encoder.*` weights into `model.encoder` (fine-tuning starts there).

    The architecture must match; n_max and dropout may differ (positions are computed, pooling and
    dropout hold no weights), so a model pretrained on 512-token sequences fine-tunes at n_max 4096.
    Returns the pretrained model config."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    pretrained, ours = dict(saved["model_config"]), asdict(model.cfg)
    differ = [key for key in ours if key not in ("n_max", "dropout", "num_labels") and pretrained.get(key) != ours[key]]
    if differ:
        raise ValueError(f"{checkpoint} differs from this model in {', '.join(differ)}")
    weights = saved["model"]
    encoder = {key.removeprefix("encoder."): weights[key] for key in weights if key.startswith("encoder.")}
    model.encoder.load_state_dict(encoder)
    return pretrained


def keep_weights(out: Path, step: int, keep: int, model: nn.Module, extra: dict[str, Any] | None) -> None:
    """Write the model weights as step-<N>.pt (no optimizer state) and delete all but the newest `keep`."""
    weights = {"model": model.state_dict(), "model_config": asdict(model.cfg), "step": step, "extra": extra or {}}
    torch.save(weights, out / f"step-{step}.pt")
    for old in sorted(out.glob("step-*.pt"), key=lambda path: int(path.stem.split("-")[1]))[:-keep]:
        old.unlink()


def setup_distributed() -> tuple[int, int]:
    """(rank, world size); initialises the process group when started by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank() if world > 1 else 0), world


def learning_rate_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to min_ratio of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_for(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; biases, LayerNorm weights and 1-D tap vectors get no weight decay."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)


def train(task: Task, cfg: TrainConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train task.model; returns the summary written to out_dir/summary.json (rank 0)."""
    rank, world = setup_distributed()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = task.model.to(cfg.device)
    wrapped = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = optimizer_for(model, cfg)

    lengths = task.train_lengths()
    steps_per_epoch = len(bucketed_batches(lengths, cfg.max_tokens, cfg.max_batch, seed=cfg.seed)) // world
    # Epochs differ by a batch or two (bucketing is reshuffled), so the epoch count ends the run
    # and total_steps is the schedule's (and progress bar's) estimate; max_steps, when set, is exact.
    total_steps = cfg.schedule_steps or cfg.max_steps or cfg.epochs * steps_per_epoch
    stop_at = cfg.max_steps or math.inf
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: learning_rate_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )

    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_score": -math.inf, "elapsed_s": 0.0}
    if cfg.resume and (out / "last.pt").exists():
        checkpoint = torch.load(out / "last.pt", map_location="cpu", weights_only=False)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        schedule.load_state_dict(checkpoint["schedule"])
        state = checkpoint["state"]
        if rank == 0:
            print(f"resumed from {out / 'last.pt'} at step {state['step']}, epoch {state['epoch']}")

    def save(name: str) -> None:
        if rank == 0:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(),
                    "state": state,
                    "model_config": asdict(model.cfg),
                    "train_config": asdict(cfg),
                    "extra": extra or {},
                },
                out / f"{name}.pt.tmp",
            )
            os.replace(out / f"{name}.pt.tmp", out / f"{name}.pt")

    def log(record: dict) -> None:
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    progress = tqdm(
        total=total_steps, initial=state["step"], disable=rank != 0, unit="step", dynamic_ncols=True
    )
    started = time.perf_counter() - state["elapsed_s"]
    window_tokens, window_start = 0, time.perf_counter()
    while state["step"] < stop_at and state["epoch"] < cfg.epochs:
        batches = bucketed_batches(lengths, cfg.max_tokens, cfg.max_batch, seed=cfg.seed + state["epoch"])
        batches = batches[: len(batches) // world * world][rank::world]  # equal share per process
        wrapped.train()
        for indices in batches[state["batch_in_epoch"] :]:
            batch = to_device(task.collate(indices), cfg.device)
            loss, n_tokens = task.loss(wrapped, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            optimizer.step()
            schedule.step()
            state["step"] += 1
            state["batch_in_epoch"] += 1
            window_tokens += n_tokens * world
            now = time.perf_counter()
            if now - window_start > 5:
                progress.set_postfix(
                    loss=f"{loss.item():.4f}", tok_s=f"{window_tokens / (now - window_start):,.0f}"
                )
                log({"step": state["step"], "epoch": state["epoch"], "train_loss": loss.item(),
                     "lr": schedule.get_last_lr()[0], "tokens_per_s": window_tokens / (now - window_start),
                     "elapsed_s": now - started})  # fmt: skip
                window_tokens, window_start = 0, now
            progress.update(1)
            if cfg.eval_every and state["step"] % cfg.eval_every == 0 and rank == 0:
                metrics = task.evaluate(model, "dev")
                log({"step": state["step"], "epoch": state["epoch"],
                     **{f"dev_{name}": value for name, value in metrics.items()}, "elapsed_s": now - started})
                progress.write(f"step {state['step']}: dev {metrics}")
            if state["step"] % cfg.save_every == 0:
                state["elapsed_s"] = time.perf_counter() - started
                save("last")
                if cfg.keep_checkpoints and rank == 0:
                    keep_weights(out, state["step"], cfg.keep_checkpoints, model, extra)
            if state["step"] >= stop_at:
                break
        else:
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
        state["elapsed_s"] = time.perf_counter() - started
        if rank == 0:
            metrics = task.evaluate(model, "dev")
            dev = {f"dev_{name}": value for name, value in metrics.items()}
            log({"step": state["step"], "epoch": state["epoch"], **dev, "elapsed_s": state["elapsed_s"]})
            progress.write(f"epoch {state['epoch']} step {state['step']}: dev {metrics}")
            if metrics["score"] > state["best_score"]:
                state["best_score"] = metrics["score"]
                save("best")
        save("last")
        if world > 1:
            dist.barrier()
    progress.close()

    summary: dict[str, Any] = {}
    if rank == 0:
        best = torch.load(out / "best.pt", map_location=cfg.device, weights_only=False)
        model.load_state_dict(best["model"])
        summary = {
            "steps": state["step"],
            "epochs_completed": state["epoch"],
            "train_wall_s": round(state["elapsed_s"], 1),
            "processes": world,
            "threads_per_process": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else "cpu",
            "parameters": sum(p.numel() for p in model.parameters()),
            "best_dev_score": state["best_score"],
            "dev": task.evaluate(model, "dev"),
            "test": task.evaluate(model, "test"),
            "model_config": asdict(model.cfg),
            "train_config": asdict(cfg),
            **(extra or {}),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps({k: summary[k] for k in ("steps", "train_wall_s", "parameters", "dev", "test")}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary
