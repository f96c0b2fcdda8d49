"""Causal-language-model pre-training of an unchanged Hugging Face ``transformers`` Llama or GPT-2.

The LightningModule holds the model as it is (``self.model``, a ``LlamaForCausalLM`` or
``GPT2LMHeadModel``) and trains it with the model's own loss: ``self.model(input_ids=ids,
labels=ids).loss``. The pipeline splits the model's block container, named by
:attr:`CausalLM.strategy_defaults` (``model.model.layers``, ``model.transformer.h``): the command
line passes it as ``strategy.module`` unless the run sets that itself.

- Sizes (:data:`SIZES`, each a ``LlamaConfig``; GPT-2 takes the same widths and depths):
  ``tiny`` for tests, ``small``, ``1b``, ``3b``, ``7b``. ``build="auto"`` creates the model in
  ``configure_model()`` above 100M parameters, so that under the pipeline each rank materialises
  only its stage (initialised by the model's own ``_init_weights``).
- ``weights``: a ``save_pretrained`` directory (or a hub snapshot on disk) to start from: the
  architecture comes from its ``config.json`` (``size`` and ``model_type`` are then unused), the
  tensors from its files. Built on a device, the model loads them itself (``from_pretrained``);
  built on the meta device under the pipeline, the strategy's ``weights=`` loads each stage's.
  Nothing is downloaded.
- Text: the Python standard library's docstrings or the user's files, with a word tokenizer built
  locally, or the tokenizer saved with ``weights`` (:mod:`lightning_pipe.recipes.text`).
- AdamW (no weight decay on biases and norms) with linear warm-up and a cosine decay to
  ``min_lr_ratio`` of the learning rate.

``transformers`` is an optional dependency: ``pip install "lightning-pipe[hf]"``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_pipe.recipes import builds_in_configure_model, require_transformers
from lightning_pipe.recipes.text import CLS, PAD, SEP, CorpusData
from lightning_pipe.recipes.warmup import warmup_then_decay
from lightning_pipe.runtime.loss_weights import token_count

_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
# each size's LlamaConfig fields
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(zip(_FIELDS, (64, 256, 4, 4, 4))),
    "small": dict(zip(_FIELDS, (512, 1408, 8, 8, 8))),
    "1b": dict(zip(_FIELDS, (2048, 8192, 16, 32, 8))),
    "3b": dict(zip(_FIELDS, (3072, 8192, 28, 24, 8))),
    "7b": dict(zip(_FIELDS, (4096, 11008, 32, 32, 32))),
}
MODEL_TYPES = ("llama", "gpt2")
# where each model type keeps its blocks (an nn.ModuleList), from the model's top
BLOCKS = {"llama": "model.layers", "gpt2": "transformer.h"}


def _transformers() -> ModuleType:
    return require_transformers("recipe=llama (a transformers model)")


def model_config(
    model_type: str = "llama",
    size: str = "tiny",
    vocab_size: int = 8000,
    max_len: int = 128,
    dropout: float = 0.0,
    hidden: int | None = None,
    num_layers: int | None = None,
    tie_embeddings: bool | None = None,
) -> Any:
    """The ``transformers`` configuration of a size: a ``LlamaConfig``, or for ``gpt2`` a
    ``GPT2Config`` of the same width, depth, heads and feed-forward width (GPT-2 has no grouped
    key-value heads). The special tokens are the word tokenizer's; ``tie_embeddings`` None keeps
    the model type's own choice (Llama: untied, GPT-2: tied)."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"recipe.model.model_type={model_type!r}: valid types are {', '.join(MODEL_TYPES)}.")
    if size not in SIZES:
        raise ValueError(f"recipe.model.size={size!r} is unknown; valid sizes: {', '.join(SIZES)}")
    transformers = _transformers()
    dims = dict(SIZES[size])
    if hidden is not None:
        dims["hidden_size"] = hidden
    if num_layers is not None:
        dims["num_hidden_layers"] = num_layers
    tokens = dict(vocab_size=vocab_size, bos_token_id=CLS, eos_token_id=SEP, pad_token_id=PAD)
    tie = {} if tie_embeddings is None else {"tie_word_embeddings": tie_embeddings}
    if model_type == "llama":
        return transformers.LlamaConfig(
            **dims, **tokens, **tie, max_position_embeddings=max_len, attention_dropout=dropout
        )
    return transformers.GPT2Config(
        n_embd=dims["hidden_size"], n_inner=dims["intermediate_size"], n_layer=dims["num_hidden_layers"],
        n_head=dims["num_attention_heads"], n_positions=max_len, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout, **tokens, **tie,
    )  # fmt: skip


def pretrained_config(weights: str) -> Any:
    """The configuration saved in a ``save_pretrained`` directory, read from disk only."""
    directory = Path(weights).expanduser()
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"recipe.model.weights={weights}: no config.json there. Give a directory that save_pretrained wrote "
            "(or a hub snapshot already on disk: nothing is downloaded)."
        )
    return _transformers().AutoConfig.from_pretrained(str(directory), local_files_only=True)


def block_path(model: nn.Module, model_type: str) -> str:
    """The dotted path of the model's block container: known for Llama and GPT-2, else the one
    ``nn.ModuleList`` holding ``num_hidden_layers`` modules."""
    if model_type in BLOCKS:
        return BLOCKS[model_type]
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    found = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    if len(found) != 1:
        raise ValueError(
            f"{type(model).__name__} ({model_type}): cannot tell which nn.ModuleList holds its {depth} blocks "
            f"(candidates: {found or 'none'}); set strategy.module=model.<path to the blocks>."
        )
    return found[0]


class CausalLM(L.LightningModule):
    """Next-token prediction with an unchanged ``transformers`` causal LM (see the module's text).

    ``build``: ``"eager"`` creates the model in ``__init__``, ``"configure_model"`` in
    ``configure_model()``, ``"auto"`` (default) the latter above 100M parameters (``size=1b`` up)."""

    def __init__(
        self,
        model_type: str = "llama",
        size: str = "tiny",
        vocab_size: int = 8000,
        max_len: int = 128,
        dropout: float = 0.0,
        weights: str | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        max_steps: int = 1000,
        min_lr_ratio: float = 0.1,
        hidden: int | None = None,
        num_layers: int | None = None,
        tie_embeddings: bool | None = None,
        build: str = "auto",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if weights:
            self.hf_config = pretrained_config(weights)
            longest = getattr(self.hf_config, "max_position_embeddings", None)
            if longest is not None and max_len > longest:
                raise ValueError(
                    f"recipe.data.max_len={max_len}: the model at {weights} takes at most {longest} positions."
                )
        else:
            self.hf_config = model_config(
                model_type, size, vocab_size, max_len, dropout, hidden, num_layers, tie_embeddings
            )
        self.hf_config.loss_type = "ForCausalLM"  # what it is already; unset, transformers warns at the first loss
        self.model: nn.Module | None = None
        self._blocks: str | None = BLOCKS.get(self.hf_config.model_type)
        if not builds_in_configure_model(build, self._new_model):
            self.configure_model()

    def _new_model(self) -> nn.Module:
        return _transformers().AutoModelForCausalLM.from_config(self.hf_config)

    def configure_model(self) -> None:
        """Create the model (here above 100M parameters, see ``build``). On the meta device (the
        pipeline's deferred build) the strategy initialises each stage and loads ``weights``; on a
        device the model loads ``weights`` itself."""
        if self.model is not None:
            return
        weights = self.hparams.weights
        if weights and torch.empty(0).device.type != "meta":
            auto = _transformers().AutoModelForCausalLM
            self.model = auto.from_pretrained(
                str(Path(weights).expanduser()), local_files_only=True, dtype=torch.float32
            )
        else:
            self.model = self._new_model()

    @property
    def strategy_defaults(self) -> dict[str, Any]:
        """Arguments of ``PipelineStrategy`` this model needs unless the run sets them: ``module``,
        the block container to split; ``weights``, when the model is not built yet (it will be
        on the meta device, and each stage loads its part of the checkpoint); ``loss_weight``, the
        tokens the model's loss averages over (labels other than -100, shifted: the batch is the
        labels), so that the pipeline trains on the batch's token mean. This recipe's rows have no
        -100 label, so every micro-batch's count is its size times ``max_len - 1``; a batch whose
        labels leave tokens out needs the count. ``balance`` by parameters: the first and the last
        stage also hold the embeddings and the head."""
        if self._blocks is None:  # another model type from `weights`: look for its blocks on the meta device
            with torch.device("meta"):
                self._blocks = block_path(self._new_model(), self.hf_config.model_type)
        weights = self.hparams.weights if self.model is None else None
        return {
            "module": f"model.{self._blocks}",
            "weights": str(Path(weights).expanduser()) if weights else None,
            "loss_weight": token_count(labels=None, shift=True),
            "balance": "parameters",
        }

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(input_ids=ids, use_cache=False).logits

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        # no sync_dist=True: under the pipeline every rank logs the last stage's value already (see bert.py)
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decayed = [p for p in self.parameters() if p.dim() >= 2]  # matrices and embeddings, not biases and norms
        kept = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decayed, "weight_decay": hp.weight_decay}, {"params": kept, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.lr, betas=(0.9, 0.95))
        schedule = warmup_then_decay(optimizer, hp.warmup_steps, hp.max_steps, "cosine", hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class CausalTextData(CorpusData):
    """Rows of token ids for next-token prediction: a batch is one ``(batch, max_len)`` tensor, the
    model shifts the labels itself. ``tokenizer``: the directory of the model's ``weights``, whose
    saved tokenizer then replaces the word tokenizer."""

    def dataset(self, rows: torch.Tensor, seed: int) -> torch.Tensor:
        return rows  # a map-style dataset already: row i is rows[i]
