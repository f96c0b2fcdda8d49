"""Unchanged Hugging Face models in LightningModules, and their data, for the tests (importable by
spawned processes). Needs ``transformers``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def gpt2(layers: int = 4, tied: bool = True) -> nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=96, n_positions=16, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     tie_word_embeddings=tied)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama(tied: bool, layers: int = 4) -> nn.Module:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      tie_word_embeddings=tied, max_position_embeddings=64, bos_token_id=0,
                                      eos_token_id=0)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def vit(layers: int = 4) -> nn.Module:
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                    intermediate_size=64, image_size=8, patch_size=4, num_channels=3, num_labels=5,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return transformers.ViTForImageClassification(config)


def swin(layers: int = 4, classify: bool = True) -> nn.Module:
    """A tiny Swin (one block per Swin stage, each stage but the last halving the patch grid: 16, 8, 4, 2 for
    32x32 images); ``classify``: ``SwinForImageClassification``, else ``SwinModel`` (no loss of its own)."""
    config = transformers.SwinConfig(image_size=32, patch_size=2, num_channels=3, embed_dim=8, depths=[1] * layers,
                                     num_heads=[2] * layers, window_size=2, num_labels=5, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0)  # fmt: skip
    return transformers.SwinForImageClassification(config) if classify else transformers.SwinModel(config)


def mixtral(layers: int = 4, router_logits: bool = False) -> nn.Module:
    """A tiny Mixtral (4 experts, 2 per token); ``router_logits``: its load-balancing loss on, with a
    coefficient (0.02) that moves the routers visibly within a few steps."""
    config = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32, bos_token_id=0,
                                        eos_token_id=0, output_router_logits=router_logits,
                                        router_aux_loss_coef=0.02)  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def qwen2_moe(layers: int = 4, router_logits: bool = False) -> nn.Module:
    """A tiny Qwen2-MoE (4 experts, 2 per token, a shared expert); ``router_logits``: its
    load-balancing loss on (coefficient 0.02)."""
    config = transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64, num_hidden_layers=layers,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=32, bos_token_id=0,
                                         eos_token_id=0, output_router_logits=router_logits,
                                         router_aux_loss_coef=0.02)  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


def qwen3_moe(layers: int = 4, router_logits: bool = False) -> nn.Module:
    """A tiny Qwen3-MoE (4 experts, 2 per token) whose block 1 is dense (``mlp_only_layers``: it
    records no router logits); ``router_logits``: its load-balancing loss on (coefficient 0.02)."""
    config = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                         max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                         output_router_logits=router_logits, router_aux_loss_coef=0.02)  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def olmoe(layers: int = 4, router_logits: bool = False) -> nn.Module:
    """A tiny OLMoE (4 experts, 2 per token); ``router_logits``: its load-balancing loss on (0.02)."""
    config = transformers.OlmoeConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=32, pad_token_id=None,
                                      bos_token_id=0, eos_token_id=0, output_router_logits=router_logits,
                                      router_aux_loss_coef=0.02)  # fmt: skip
    return transformers.OlmoeForCausalLM(config)


#: name -> (builder taking the number of blocks (default 4), the path of its block container in :class:`HFModule`)
MODELS: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "gpt2": (gpt2, "model.transformer.h"),
    "llama_gqa_tied": (lambda layers=4: llama(True, layers), "model.model.layers"),
    "llama_gqa_untied": (lambda layers=4: llama(False, layers), "model.model.layers"),
    "vit": (vit, "model.vit.layers"),
    # the head's bias one parameter under two names, the decoder's weight tied to the embeddings
    "bert_mlm": (lambda layers=4: _bert_mlm(layers), "model.bert.encoder.layer"),
}

#: the mixture-of-experts models, as :data:`MODELS`; kept out of its parity grid, where Mixtral under
#: AdamW on 4 processes with interleaved 1F1B (8 blocks) differed from plain training by 1.9e-3, 6x
#: the control's 3.2e-4 (not yet explained); every SGD cell of the grid matched. See
#: tests/runtime/blocks/test_block_reads.py.
MOE_MODELS: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "mixtral": (mixtral, "model.model.layers"),
    "qwen2_moe": (qwen2_moe, "model.model.layers"),
    "qwen3_moe": (qwen3_moe, "model.model.layers"),
    "olmoe": (olmoe, "model.model.layers"),
}


class BertLastFourCLS(L.LightningModule):
    """A BERT classifier on the mean of the last 4 layers' [CLS] hidden states
    (``output_hidden_states``), a common fine-tuning recipe, with a probe loss on layer 1's [CLS];
    ``select``: ask for those 5 hidden states only (``output_hidden_states=[1, -4, -3, -2, -1]``:
    transformers records None for the others), and add a term on layer 0's attention weights
    (``output_attentions``, eager attention)."""

    def __init__(self, layers: int = 4, select: bool = False) -> None:
        super().__init__()
        config = transformers.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                         intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, attn_implementation="eager")  # fmt: skip
        self.bert = transformers.BertModel(config, add_pooling_layer=False)
        self.classifier = nn.Linear(64, 3)
        self.probe = nn.Linear(64, 3)
        self.select = select

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        asked: bool | list[int] = [1, -4, -3, -2, -1] if self.select else True
        out = self.bert(input_ids=ids, output_hidden_states=asked, output_attentions=self.select)
        hidden = out.hidden_states
        cls = torch.stack([h[:, 0] for h in hidden[-4:]]).mean(0)
        attended = out.attentions[0][:, :, 0, 0].mean() if self.select else torch.zeros(())
        return self.classifier(cls), self.probe(hidden[1][:, 0]), attended

    def _loss(self, batch: Any) -> torch.Tensor:
        ids, labels = batch
        logits, probed, attended = self(ids)
        target = labels[:, 0] % 3
        return (
            nn.functional.cross_entropy(logits, target) + 0.5 * nn.functional.cross_entropy(probed, target) + attended
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _bert_mlm(layers: int) -> nn.Module:
    from tests.hf_families import bert_mlm

    return bert_mlm(layers)


class HFModule(L.LightningModule):
    """An unchanged Hugging Face model; its own loss (``labels=``) is the training loss."""

    def __init__(
        self, build: Callable[[], nn.Module], optimizer: str = "sgd", lr: float = 0.1, microbatches: int = 1
    ) -> None:
        super().__init__()
        self.model = build()
        self.optimizer = optimizer
        self.lr = lr
        self.microbatches = microbatches  # > 1: the float-noise control (the loss summed over micro-batches)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Any:
        if inputs.is_floating_point():
            return self.model(pixel_values=inputs, labels=labels)
        return self.model(input_ids=inputs, labels=labels, use_cache=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        if self.microbatches > 1:  # as the pipeline weights its micro-batches
            parts = zip(inputs.tensor_split(self.microbatches), labels.tensor_split(self.microbatches))
            return sum(self(x, y).loss * (len(x) / len(inputs)) for x, y in parts)
        loss = self(inputs, labels).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, labels = batch
        if self.microbatches > 1:  # as the pipeline weights its micro-batches' logged values
            parts = zip(inputs.tensor_split(self.microbatches), labels.tensor_split(self.microbatches))
            self.log("val_loss", sum(self(x, y).loss * (len(x) / len(inputs)) for x, y in parts))
            return
        self.log("val_loss", self(inputs, labels).loss)

    def outputs(self, inputs: torch.Tensor) -> Any:
        """The model's outputs without labels (for ``predict``)."""
        if inputs.is_floating_point():
            return self.model(pixel_values=inputs)
        return self.model(input_ids=inputs, use_cache=False)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The last position's logits (a small result: the launcher hands it back through a pipe), and beside
        them a mixture of experts' load-balancing loss (``aux_loss``, read from every block's router logits)
        per forward: a micro-batch's under the pipeline, as here with ``microbatches`` > 1."""
        inputs, _ = batch
        parts = inputs.tensor_split(self.microbatches) if self.microbatches > 1 else (inputs,)
        outputs = []
        for x in parts:
            out = self.outputs(x)
            aux = getattr(out, "aux_loss", None)
            flat = out.logits[:, -1] if out.logits.dim() == 3 else out.logits
            outputs.append(flat if aux is None else torch.cat([flat, aux.expand(len(x), 1)], 1))
        return torch.cat(outputs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr * 0.1, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def data_for(name: str, n: int = 48, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """Token sequences (labels = inputs: the model shifts them) or small images with class labels."""
    g = torch.Generator().manual_seed(seed)
    if name in ("vit", "swin"):
        side = 32 if name == "swin" else 8
        data = TensorDataset(torch.randn(n, 3, side, side, generator=g), torch.randint(0, 5, (n,), generator=g))
    else:
        tokens = torch.randint(1, 96, (n, 12), generator=g)
        data = TensorDataset(tokens, tokens)
    return DataLoader(data, batch_size=batch_size, shuffle=False)


class GPT2Embed(nn.Module):
    """GPT-2's token and position embeddings as one layer of a Sequential."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = transformer.wte, transformer.wpe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))


class GPT2Head(nn.Module):
    """GPT-2's final norm and head as one layer of a Sequential."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


class BesideModule(L.LightningModule):
    """The Hugging Face GPT-2 kept as ``self.hf`` (for ``generate`` and ``save_pretrained``) beside a
    Sequential of its own parts, which the steps call: every parameter reachable under two names,
    the embedding tied to the head across the first and last stage."""

    def __init__(self, layers: int = 4, tied: bool = True) -> None:
        super().__init__()
        self.hf = gpt2(layers, tied)
        self.layers = nn.Sequential(GPT2Embed(self.hf.transformer), *self.hf.transformer.h, GPT2Head(self.hf))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        logits = self.layers(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


#: A Llama of 1.13 GB in float32 (284M parameters: 16 blocks of hidden 1024 with GQA, a 32000-token
#: vocabulary, untied head), and a tiny one of the same shape for quick checks.
LLAMA_1GB = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False,
                 max_position_embeddings=64)  # fmt: skip
LLAMA_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, tie_word_embeddings=True,
                  max_position_embeddings=64)  # fmt: skip


class DeferredLlama(L.LightningModule):
    """A Hugging Face Llama built in ``configure_model()`` (on the meta device under the pipeline:
    each rank materialises only its stage, initialised by HF's own rules)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        self.config = config
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**self.config, bos_token_id=0, eos_token_id=0)
            )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels, use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def token_data(vocab: int, n: int = 8, length: int = 8, batch_size: int = 4) -> DataLoader:
    tokens = torch.randint(1, vocab, (n, length), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens, tokens), batch_size=batch_size)


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory figure, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


class PeakMemory(L.Callback):
    """Each rank's peak resident memory from before ``configure_model`` (the peak counter reset
    there) to the start of training, the split and materialisation included, and the bytes of the
    tensors its module holds then; written to ``<folder>/memory<k>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
        self.base = _status("VmRSS")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json

        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pl_module.state_dict().values()
        }
        peak = _status("VmHWM") - self.base
        with open(f"{self.folder}/memory{trainer.global_rank}.json", "w") as f:
            json.dump({"peak": peak, "held": sum(storages.values())}, f)


def padded_token_data(name: str, n: int = 48, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """Token rows whose labels leave out different numbers of positions (-100) per sample: for
    ``gpt2`` a padded tail of random length (labels = inputs, the model shifts them), for
    ``bert_mlm`` a random share of positions masked (token 1 in the inputs, the others -100).
    Samples 2 and 3 have no label at all, so with 4 micro-batches of 8 one micro-batch has none.
    ``bert_mlm`` batches are ``(ids, mask, labels)``, as the BERT recipe's."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 96, (n, 12), generator=g)
    positions = torch.arange(12).expand(n, 12)
    if name == "gpt2":
        keep = positions < torch.randint(1, 13, (n, 1), generator=g)
        inputs = tokens
    else:
        keep = torch.rand(n, 12, generator=g) < torch.rand(n, 1, generator=g)
        inputs = torch.where(keep, torch.ones_like(tokens), tokens)
    keep[2:4] = False
    labels = torch.where(keep, tokens, torch.full_like(tokens, -100))
    columns = (inputs, labels) if name == "gpt2" else (inputs, torch.ones_like(inputs, dtype=torch.bool), labels)
    return DataLoader(TensorDataset(*columns), batch_size=batch_size)


class PooledBert(L.LightningModule):
    """A BERT classifying from the mean of its last 4 layers' [CLS] hidden states
    (``output_hidden_states``: what transformers records crosses stages), or, with ``sequential``, the
    same BERT (kept as ``self.bert``) run as a Sequential of its own parts whose layers pass on a tuple:
    the hidden state and every layer's [CLS] so far (the tuple crosses stages): the same function
    with nothing recorded, for the rules whose references are written for Sequentials."""

    def __init__(self, layers: int = 4, sequential: bool = False) -> None:
        super().__init__()
        config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)  # fmt: skip
        self.bert = transformers.BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(32, 3)
        self.sequential = sequential
        if sequential:
            self.layers = nn.Sequential(
                _ClsEmbed(self.bert.embeddings), *(_ClsLayer(b) for b in self.bert.encoder.layer), _ClsHead(self.head)
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.sequential:
            return self.layers(ids)
        hidden = self.bert(input_ids=ids, output_hidden_states=True).hidden_states
        return self.head(torch.stack([h[:, 0] for h in hidden[-4:]], 1).mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return nn.functional.cross_entropy(self(ids), labels[:, 0] % 3)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _ClsEmbed(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embeddings(input_ids=ids)
        return hidden, hidden[:, None, 0]


class _ClsLayer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, cls = value
        hidden = self.layer(hidden)
        return hidden, torch.cat([cls, hidden[:, None, 0]], 1)


class _ClsHead(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.head(value[1][:, -4:].mean(1))


class DictBatchLM(L.LightningModule):
    """An unchanged Hugging Face LM fed the Hugging Face way: dict batches, ``model(**batch).loss``."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.model = build()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch, use_cache=False).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, columns: dict[str, torch.Tensor]) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.columns.items()}


def padded_dict_data(n: int = 32, batch_size: int = 8, length: int = 12, seed: int = 0) -> DataLoader:
    """Right-padded token rows of random lengths (pad token 0, attention mask 0, labels -100), as a
    padding collator gives them: dict batches of ``input_ids``, ``attention_mask`` and ``labels``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 96, (n, length), generator=g)
    keep = torch.arange(length).expand(n, length) < torch.randint(2, length + 1, (n, 1), generator=g)
    columns = {
        "input_ids": torch.where(keep, tokens, torch.zeros_like(tokens)),
        "attention_mask": keep.long(),
        "labels": torch.where(keep, tokens, torch.full_like(tokens, -100)),
    }
    return DataLoader(_Rows(columns), batch_size=batch_size)


class PooledSwin(L.LightningModule):
    """An unchanged ``SwinModel`` and a classifier of its own on the pooled output."""

    def __init__(self) -> None:
        super().__init__()
        self.model = swin(classify=False)
        self.classifier = nn.Linear(self.model.num_features, 5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        pooled = self.model(pixel_values=images).pooler_output
        loss = nn.functional.cross_entropy(self.classifier(pooled), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
