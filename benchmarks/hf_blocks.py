"""What running the model's own forward on every stage costs: an unchanged Hugging Face GPT-2 split
by its block container (``module="model.transformer.h"``) against the same model rewritten as an
``nn.Sequential`` of its parts, on 2 CPU processes, in alternating rounds.

    python benchmarks/hf_blocks.py --rounds 6

Both runs train the same weights on the same batches with the same schedule; the block container
also runs, on the second stage, what comes before the first block (the position embedding, the
mask; the token embedding as a stand-in). A step's time is taken on rank 0 between the ends of
consecutive steps (see ``step_time.py``); the ratio is the median of the per-round ratios of
median step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.step_time import StepTimer
from lightning_pipe import PipelineStrategy
from tests.hf_models import GPT2Embed, GPT2Head


def gpt2(args: argparse.Namespace) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64,
                                     vocab_size=args.vocab, n_positions=args.length, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


class Unchanged(L.LightningModule):
    """The HF model as it is; its own loss."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.model = gpt2(args)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Rewritten(Unchanged):
    """The same model as a Sequential of its parts (what users wrote before block containers)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.layers = nn.Sequential(GPT2Embed(self.model.transformer), *self.model.transformer.h, GPT2Head(self.model))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.layers(ids)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def run(args: argparse.Namespace, kind: str, path: str) -> list[float]:
    torch.manual_seed(0)
    model = Unchanged(args) if kind == "blocks" else Rewritten(args)
    tokens = torch.randint(0, args.vocab, (args.batch * 8, args.length))
    data = DataLoader(TensorDataset(tokens), batch_size=args.batch)
    module = "model.transformer.h" if kind == "blocks" else "layers"
    strategy = PipelineStrategy(module=module, chunks=args.chunks, start_method="fork")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, max_epochs=-1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StepTimer(path, args.warmup)],
    )  # fmt: skip
    trainer.fit(model, data)
    with open(path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = f"/tmp/lightning_pipe_hf_blocks_{os.getpid()}.json"
    medians: dict[str, list[float]] = {"blocks": [], "sequential": []}
    for r in range(args.rounds):  # alternate, and swap the order every round
        for kind in ("blocks", "sequential") if r % 2 == 0 else ("sequential", "blocks"):
            medians[kind].append(statistics.median(run(args, kind, tmp)))
    ratios = [b / s for b, s in zip(medians["blocks"], medians["sequential"])]
    print(json.dumps({
        "config": vars(args),
        "blocks_median_s": statistics.median(medians["blocks"]),
        "sequential_median_s": statistics.median(medians["sequential"]),
        "per_round_ratio_blocks_over_sequential": [round(r, 3) for r in ratios],
        "median_ratio": statistics.median(ratios),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
