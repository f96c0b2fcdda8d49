"""What carrying the router logits costs: a tiny Mixtral (``output_router_logits=True``, the
load-balancing loss on) against the same model with it off, split by its block container on 2 CPU
processes under ``1f1b``. One process tree per run, so that a harness can pair runs of the two in
alternating rounds:

    python benchmarks/moe_aux_loss.py --aux on
    python benchmarks/moe_aux_loss.py --aux off

Each run prints the median seconds per step on rank 0 after the warm-up steps (see ``step_time.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

import lightning as L
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.step_time import StepTimer
from lightning_pipe import PipelineStrategy


class Mixtral(L.LightningModule):
    """An unchanged ``MixtralForCausalLM``; its own loss (with the load-balancing loss when on)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        config = transformers.MixtralConfig(
            vocab_size=args.vocab, hidden_size=args.width, intermediate_size=2 * args.width,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=args.length,
            output_router_logits=args.aux == "on", router_aux_loss_coef=0.02,
        )  # fmt: skip
        self.model = transformers.MixtralForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aux", choices=["on", "off"], required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch * args.steps, args.length))
    path = os.path.join(tempfile.mkdtemp(), "steps.json")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=args.steps, max_epochs=-1, logger=False,
        strategy=PipelineStrategy(module="model.model.layers", chunks=args.chunks, start_method="fork"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StepTimer(path, args.warmup)],
    )  # fmt: skip
    trainer.fit(Mixtral(args), DataLoader(TensorDataset(tokens), batch_size=args.batch))
    with open(path) as f:
        print(json.dumps({"aux": args.aux, "median_step_s": statistics.median(json.load(f))}))


if __name__ == "__main__":
    main()
