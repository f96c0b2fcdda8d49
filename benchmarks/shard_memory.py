"""What ``data_parallel="shard"`` saves per rank on a Llama-shaped model through ``module=``: the bytes
of parameters and optimizer state each rank holds at 2 stages x 2 replicas, replicated against
sharded (FSDP2 over each stage's replicas, the embeddings, final norm and head included).

    python benchmarks/shard_memory.py                  # 8 blocks of width 1024, vocabulary 32000, AdamW
    python benchmarks/shard_memory.py --only shard --steps 12 --width 512 --vocab 8000 --out times.json
                                                       # one layout, its median step time after 4 warm-up steps

Each layout trains 2 steps on 4 CPU processes; after the fit every rank counts the bytes of its own
parameters (its shards under ``shard``) and of its optimizer's state tensors. The bytes are
structural (no timing), so a busy machine does not change them. Results in
``benchmarks/results/shard_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_pipe.runtime.replicas.sharding import local


class CountBytes(L.Callback):
    """Writes, per rank, the bytes of its parameters (local shards) and of its optimizer state to
    ``<folder>/bytes<k>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seen: set[int] = set()
        params = 0
        for p in pl_module.parameters():
            t = local(p.detach())
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                params += t.numel() * t.element_size()
        state = 0
        for optimizer in trainer.optimizers:
            for entry in optimizer.state.values():
                for value in entry.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        t = local(value)
                        state += t.numel() * t.element_size()
        with open(f"{self.folder}/bytes{trainer.global_rank}.json", "w") as f:
            json.dump({"parameters": params, "optimizer": state}, f)


class StepTime(L.Callback):
    """Rank 0's median step time after ``warmup`` steps (end to end, loading included) to ``<folder>/time.json``."""

    def __init__(self, folder: str, warmup: int = 4) -> None:
        self.folder, self.warmup, self.ends = folder, warmup, []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = [b - a for a, b in zip(self.ends[self.warmup :], self.ends[self.warmup + 1 :])]
        if trainer.global_rank == 0 and steps:
            with open(f"{self.folder}/time.json", "w") as f:
                json.dump(statistics.median(steps), f)


def llama(blocks: int, width: int, vocab: int) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=width,
        intermediate_size=width * 7 // 2,
        num_hidden_layers=blocks,
        num_attention_heads=width // 64,
        num_key_value_heads=width // 256,
        vocab_size=vocab,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def main() -> None:
    from tests.hf_models import HFModule, data_for
    from tests.pipeline import fit_pipeline

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--only", choices=["replicate", "shard"], help="one layout (for timing it alone)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (the step time needs more than 5)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "shard_memory.json"))
    args = parser.parse_args()
    import tempfile

    results: dict[str, Any] = {"model": vars(args) | {"out": None}, "layouts": {}}
    for mode in [args.only] if args.only else ["replicate", "shard"]:
        torch.manual_seed(0)
        module = HFModule(lambda: llama(args.blocks, args.width, args.vocab), optimizer="adamw")
        with tempfile.TemporaryDirectory() as folder:
            data = data_for("llama", n=8 * args.steps, batch_size=4)
            fit_pipeline(module, 4, data, module="model.model.layers", stages=2, data_parallel=mode, chunks=2,
                         max_steps=args.steps, callbacks=[CountBytes(folder), StepTime(folder)])  # fmt: skip
            ranks = []
            for r in range(4):
                with open(f"{folder}/bytes{r}.json") as f:
                    ranks.append(json.load(f))
            if os.path.exists(f"{folder}/time.json"):
                with open(f"{folder}/time.json") as f:
                    results.setdefault("median_step_s", {})[mode] = json.load(f)
        results["layouts"][mode] = ranks
        print(mode, ranks, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
