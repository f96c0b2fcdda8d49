"""recipe=llama: an unchanged transformers Llama / GPT-2 as a causal LM (needs the hf extra)."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from omegaconf import open_dict
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from lightning_pipe import token_count  # noqa: E402
from lightning_pipe.cli import build_strategy, run  # noqa: E402
from lightning_pipe.recipes.llama import CausalLM, CausalTextData, block_path, model_config  # noqa: E402
from lightning_pipe.recipes.text import WordTokenizer, stdlib_documents  # noqa: E402
from tests.models import fit_plain  # noqa: E402
from tests.pipeline import assert_same_weights, fit_pipeline  # noqa: E402
from tests.test_cli import SMALL, _compose  # noqa: E402

WORD = r"[a-z0-9]+|[^\sa-z0-9]"  # the word tokenizer's pieces (lightning_pipe/recipes/text.py)


def _parameters(model: CausalLM) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in model._new_model().parameters())


def test_sizes_are_llama_configs_built_where_their_size_says() -> None:
    tiny = CausalLM(size="tiny", vocab_size=500, max_len=32)
    assert isinstance(tiny.hf_config, transformers.LlamaConfig) and tiny.hf_config.hidden_size == 64
    assert isinstance(tiny.model, transformers.LlamaForCausalLM) and len(tiny.model.model.layers) == 4
    large = CausalLM(size="1b")  # above 100M parameters: created in configure_model()
    assert large.model is None and 0.9e9 < _parameters(large) < 1.1e9
    assert 2.5e9 < _parameters(CausalLM(size="3b")) < 3.2e9
    gpt2 = CausalLM(model_type="gpt2", size="tiny", vocab_size=500, max_len=32)
    assert isinstance(gpt2.model, transformers.GPT2LMHeadModel) and gpt2.hf_config.n_inner == 256
    assert gpt2.model.lm_head.weight is gpt2.model.transformer.wte.weight  # GPT-2 ties them; Llama does not
    assert tiny.model.lm_head.weight is not tiny.model.model.embed_tokens.weight
    assert model_config("gpt2", "tiny", tie_embeddings=False).tie_word_embeddings is False
    with pytest.raises(ValueError, match="valid sizes: tiny, small, 1b, 3b, 7b"):
        CausalLM(size="huge")
    with pytest.raises(ValueError, match="valid types are llama, gpt2"):
        CausalLM(model_type="bert")


def test_the_recipe_names_its_blocks_for_the_strategy_and_an_override_wins() -> None:
    cfg = _compose(["recipe=llama"])
    model = CausalLM(size="tiny", vocab_size=500, max_len=32)
    strategy, _ = build_strategy(cfg.strategy, 2, model.strategy_defaults)
    assert strategy.config.module == "model.model.layers" and strategy.weights is None
    gpt2 = CausalLM(model_type="gpt2", size="tiny", vocab_size=500, max_len=32)
    assert build_strategy(cfg.strategy, 2, gpt2.strategy_defaults)[0].config.module == "model.transformer.h"
    cfg = _compose(["recipe=llama", "strategy.module=model.model"])
    assert build_strategy(cfg.strategy, 2, model.strategy_defaults)[0].config.module == "model.model"
    assert build_strategy(_compose(["strategy=none"]).strategy, 1, model.strategy_defaults) == ("auto", 1)
    assert strategy.config.loss_weight == token_count(labels=None, shift=True)  # the batch's token mean
    cfg = _compose(["recipe=llama", "strategy.loss_weight=samples"])
    assert build_strategy(cfg.strategy, 2, model.strategy_defaults)[0].config.loss_weight == "samples"


def test_the_loss_falls_without_the_pipeline(tmp_path: Path) -> None:
    """``lightning-pipe recipe=llama strategy=none``: the composed recipe trains, its loss falling."""
    cfg = _compose(["recipe=llama", "strategy=none", "trainer.devices=1", *SMALL["llama"], "trainer.max_steps=30",
                    "recipe.model.warmup_steps=5", "trainer.val_check_interval=30", "trainer.limit_val_batches=1",
                    "trainer.log_every_n_steps=1"])  # fmt: skip
    with open_dict(cfg):
        del cfg.hydra
    metrics = run(cfg, output_dir=str(tmp_path))
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        losses = [float(row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses  # from about ln(500) = 6.2
    assert metrics["val_loss"] < losses[0]


def _save_pretrained(directory: Path, documents: list[str]) -> WordTokenizer:
    """A tiny Llama and the word tokenizer (as a transformers tokenizer) saved as a hub checkpoint would be."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    words = WordTokenizer.build(documents, 300)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words.vocab)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(WORD), behavior="isolated")]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]", pad_token="[PAD]"
    )
    fast.save_pretrained(directory)
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(model_config("llama", "tiny", len(words), max_len=64)).save_pretrained(directory)
    return words


def test_weights_and_tokenizer_from_a_save_pretrained_directory(tmp_path: Path) -> None:
    documents = stdlib_documents(limit_chars=20_000)
    words = _save_pretrained(tmp_path / "hub", documents)
    saved = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hub"))
    model = CausalLM(weights=str(tmp_path / "hub"), size="1b", max_len=32)  # the directory's config, not size's
    assert model.hf_config.hidden_size == 64 and model.strategy_defaults["weights"] is None  # loaded already
    for name, value in saved.state_dict().items():
        assert torch.equal(model.model.state_dict()[name], value), name
    deferred = CausalLM(weights=str(tmp_path / "hub"), max_len=32, build="configure_model")
    assert deferred.strategy_defaults == {
        "module": "model.model.layers",
        "weights": str(tmp_path / "hub"),
        "loss_weight": token_count(None),
        "balance": "parameters",
    }
    with torch.device("meta"):  # the pipeline's deferred build: the strategy loads each stage's tensors
        deferred.configure_model()
    assert deferred.model.model.embed_tokens.weight.is_meta
    with pytest.raises(ValueError, match="takes at most 64 positions"):
        CausalLM(weights=str(tmp_path / "hub"), max_len=128)
    with pytest.raises(FileNotFoundError, match="no config.json there"):
        CausalLM(weights=str(tmp_path))
    # the saved tokenizer cuts the text as the word tokenizer does
    hub = CausalTextData(tokenizer=str(tmp_path / "hub"), limit_chars=20_000, max_len=32)
    assert torch.equal(hub.rows(documents), CausalTextData(vocab_size=len(words), max_len=32).rows(documents))


@pytest.mark.parametrize(
    "how",
    [["strategy=none", "trainer.devices=1"], ["strategy.start_method=fork", "recipe.model.build=configure_model"]],
    ids=["loaded-by-the-model", "loaded-by-each-stage"],
)
def test_the_command_line_starts_from_the_weights(tmp_path: Path, how: list[str]) -> None:
    """``recipe.model.weights=DIR`` (learning rate 0): the validation loss is the saved model's, whether
    the model loads the weights (built on a device) or, built on the meta device under the pipeline,
    each stage loads its part through the strategy's ``weights=``."""
    _save_pretrained(tmp_path / "hub", stdlib_documents(limit_chars=20_000))
    cfg = _compose(["recipe=llama", *how, f"recipe.model.weights={tmp_path / 'hub'}",
                    "recipe.data.limit_chars=20000", "recipe.data.max_len=32", "recipe.data.batch_size=4",
                    "recipe.model.lr=0.0", "trainer.max_steps=1", "trainer.val_check_interval=1",
                    "trainer.limit_val_batches=1"])  # fmt: skip
    with open_dict(cfg):
        del cfg.hydra
    metrics = run(cfg, output_dir=str(tmp_path / "run"))
    data = CausalTextData(tokenizer=str(tmp_path / "hub"), limit_chars=20_000, max_len=32, batch_size=4)
    data.setup()
    saved = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hub"))
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad():
        expected = float(saved(input_ids=batch, labels=batch).loss)
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_blocks_of_another_model_type_are_found_by_their_count(tmp_path: Path) -> None:
    """A checkpoint of a type the recipe has no entry for (Mistral): its one nn.ModuleList of
    num_hidden_layers modules, found on the meta device."""
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)  # fmt: skip
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    model = CausalLM(weights=str(tmp_path), max_len=32, build="configure_model")
    assert model.strategy_defaults == {
        "module": "model.model.layers",
        "weights": str(tmp_path),
        "loss_weight": token_count(None),
        "balance": "parameters",
    }
    with pytest.raises(
        ValueError, match=r"which nn.ModuleList holds its 3 blocks \(candidates: none\); set strategy.module"
    ):
        block_path(_Depth(3), "mystery")


class _Depth(torch.nn.Module):
    """A model with a depth in its config and no container of that many blocks."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.config = transformers.PretrainedConfig(num_hidden_layers=depth)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])


class RecordLosses(L.Callback):
    """Writes each rank's ``train_loss`` of every step to ``<folder>/losses<rank>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder, self.losses = folder, []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (Path(self.folder) / f"losses{trainer.global_rank}.json").write_text(json.dumps(self.losses))


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_the_recipe_trains_on_two_stages_as_without_the_pipeline(tmp_path: Path, model_type: str) -> None:
    """The recipe's module as the command line runs it (AdamW in two groups, warm-up and cosine), its
    blocks split at ``strategy_defaults["module"]``: the losses of plain training, step by step."""
    data = CausalTextData(limit_chars=40_000, vocab_size=500, max_len=32)
    data.setup()
    loader = DataLoader(data.train, batch_size=8, shuffle=False)
    torch.manual_seed(0)
    piped = CausalLM(model_type=model_type, size="tiny", vocab_size=500, max_len=32, warmup_steps=2, max_steps=8)
    reference = copy.deepcopy(piped)
    (tmp_path / "plain").mkdir()
    fit_plain(reference, loader, max_steps=8, callbacks=[RecordLosses(str(tmp_path / "plain"))])
    fit_pipeline(piped, 2, loader, max_steps=8, callbacks=[RecordLosses(str(tmp_path))], **piped.strategy_defaults)
    plain = json.loads((tmp_path / "plain" / "losses0.json").read_text())
    for rank in range(2):
        piped_losses = json.loads((tmp_path / f"losses{rank}.json").read_text())
        assert piped_losses == pytest.approx(plain, rel=1e-4, abs=1e-5), (rank, piped_losses, plain)
    assert plain[-1] < plain[0] - 0.1  # it learns (from about ln(500) = 6.2)
    assert_same_weights(reference, piped, rtol=1e-3, atol=1e-4)


def test_the_command_line_trains_on_two_processes(tmp_path: Path) -> None:
    """``lightning-pipe recipe=llama trainer.max_steps=...``: two CPU processes (forked here, not
    started afresh), one stage each, the loss falling."""
    cfg = _compose(["recipe=llama", "trainer.max_steps=30", *SMALL["llama"], "recipe.model.warmup_steps=5",
                    "trainer.log_every_n_steps=1", "trainer.val_check_interval=30", "trainer.limit_val_batches=1",
                    "strategy.start_method=fork"])  # fmt: skip
    assert (cfg.trainer.devices, cfg.strategy.name, cfg.strategy.module) == (2, "pipeline", None)  # the recipe names it
    with open_dict(cfg):
        del cfg.hydra
    metrics = run(cfg, output_dir=str(tmp_path))
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        losses = [float(row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    assert metrics["val_loss"] < losses[0]
