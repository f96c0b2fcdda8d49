import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from safetensors.torch import save_file

from lightning_pipe import PipelineStrategy
from lightning_pipe.checkpoint import write_meta, write_shard
from lightning_pipe.weights import check_weights_argument, load_local, load_stage_weights, model_spec, open_weights
from tests.models import DeferredNet, SaveStageState, TiedNet, TinyNet, fit_plain, merged_stage_states
from tests.pipeline import fit_pipeline


def built(model: L.LightningModule) -> L.LightningModule:
    model.configure_model()
    return model


def start_weights(seed: int = 11) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in built(DeferredNet()).state_dict().items()}


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_stages_from_a_weights_file_train_as_plain_training(tmp_path: Path, suffix: str) -> None:
    """A model built in configure_model starts from the file on 2 and 4 stages (each rank reading its
    own tensors) and after 6 steps equals plain training started from the same state_dict."""
    state = start_weights()
    path = tmp_path / f"start{suffix}"
    torch.save(state, path) if suffix == ".pt" else save_file(state, str(path))
    plain = built(DeferredNet())
    plain.load_state_dict(state)
    fit_plain(plain)
    expected = plain.state_dict()
    for stages in (2, 4):
        folder = tmp_path / str(stages)
        folder.mkdir()
        fit_pipeline(DeferredNet(), stages, weights=str(path), callbacks=[SaveStageState(str(folder))])
        trained = merged_stage_states(str(folder), stages)
        assert set(trained) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(
                trained[name],
                value,
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m, stages=stages, name=name: f"{stages} stages, {name}: {m}",
            )
            assert not torch.equal(value, state[name])  # training moved it


OPENED: list[str] = []  # the files safe_open opened in this process (each rank's own copy under fork)


class RecordOpened(L.Callback):
    """Each rank writes the files it opened for tensor data to ``<folder>/opened-rank<k>.json``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.folder / f"opened-rank{trainer.global_rank}.json").write_text(json.dumps(OPENED))


def save_pretrained_like(state: dict[str, torch.Tensor], directory: Path, shards: list[list[str]]) -> dict[str, str]:
    """``state`` as save_pretrained shards it: model-0000k-of-0000N.safetensors and the index."""
    directory.mkdir()
    weight_map = {}
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in names}, str(directory / file))
        weight_map |= {n: file for n in names}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_a_sharded_directory_named_without_the_modules_prefix_trains_as_plain_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Sequential's own state_dict ('0.weight', ...) saved as a sharded save_pretrained directory
    (3 shards and their index): the module's prefix 'layers.' is found; on 2 and 4 stages each rank
    opens only the shards holding its tensors, and 6 steps equal plain training from the same weights."""
    import safetensors

    real = safetensors.safe_open

    def recording(path: str, *args: Any, **kwargs: Any) -> Any:
        OPENED.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", recording)
    state = start_weights()
    saved = {k[len("layers.") :]: v for k, v in state.items()}
    groups = [
        ["0.weight", "0.bias"],
        ["2.weight", "2.bias", "4.weight", "4.bias"],
        ["6.weight", "6.bias", "7.weight", "7.bias"],
    ]
    weight_map = save_pretrained_like(saved, tmp_path / "pretrained", groups)
    plain = built(DeferredNet())
    plain.load_state_dict(state)
    fit_plain(plain)
    expected = plain.state_dict()
    for stages in (2, 4):
        folder = tmp_path / str(stages)
        folder.mkdir()
        OPENED.clear()
        fit_pipeline(DeferredNet(), stages, weights=str(tmp_path / "pretrained"),
                     callbacks=[SaveStageState(str(folder)), SaveStageState(str(folder), start=True),
                                RecordOpened(folder)])  # fmt: skip
        for rank in range(stages):
            held = torch.load(folder / f"start-rank{rank}.pt", weights_only=True)
            opened = json.loads((folder / f"opened-rank{rank}.json").read_text())
            assert sorted(opened) == sorted({weight_map[n[len("layers.") :]] for n in held}), (stages, rank)
        if stages == 4:  # layers 0-1: the first shard only
            assert json.loads((folder / "opened-rank0.json").read_text()) == ["model-00001-of-00003.safetensors"]
        trained = merged_stage_states(str(folder), stages)
        assert set(trained) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(
                trained[name],
                value,
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m, stages=stages, name=name: f"{stages} stages, {name}: {m}",
            )


def test_every_format_loads_the_same_tensors(tmp_path: Path) -> None:
    model = TiedNet()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))  # fmt: skip
    trainer.fit(model, _tied_loader())
    trainer.save_checkpoint(tmp_path / "lightning.ckpt")  # a real Lightning checkpoint
    state = model.state_dict()
    torch.save(state, tmp_path / "w.pth")
    torch.save({"state_dict": state, "epoch": 3, "hyper_parameters": {"lr": 0.1}}, tmp_path / "w.ckpt")
    from safetensors.torch import save_model

    save_model(model, str(tmp_path / "w.safetensors"))  # stores the tied tensor once
    directory = tmp_path / "pipe.ckpt"
    directory.mkdir()
    names = list(state)
    write_shard(directory, 0, {k: state[k] for k in names[:2]}, None)
    write_shard(directory, 1, {k: state[k] for k in names[2:]}, None)
    write_meta(directory, {"epoch": 0}, 2)
    spec = model_spec(TiedNet())
    for name in ("w.pth", "w.ckpt", "lightning.ckpt", "w.safetensors", "pipe.ckpt"):
        target = TiedNet()
        load_stage_weights(target, tmp_path / name, spec)
        for key, value in state.items():
            torch.testing.assert_close(target.state_dict()[key], value, rtol=0, atol=0, msg=f"{name}: {key}")
        assert target.layers[-1].weight is target.layers[0].weight


def _tied_loader() -> torch.utils.data.DataLoader:
    from tests.models import token_loader

    return token_loader()


def test_only_the_local_tensors_are_read(tmp_path: Path) -> None:
    state = TinyNet().state_dict()
    torch.save(state, tmp_path / "w.pt")
    source = open_weights(tmp_path / "w.pt")
    read: list[str] = []
    inner = source.read
    source.read = lambda name: read.append(name) or inner(name)  # type: ignore[method-assign]
    with torch.device("meta"):
        part = TinyNet()
    part.layers[6].to_empty(device="cpu")
    assert load_local(part, source, model_spec(TinyNet())) == 2
    assert sorted(read) == ["layers.6.bias", "layers.6.weight"]


def test_names_and_shapes_that_do_not_fit_are_listed(tmp_path: Path) -> None:
    spec = model_spec(TinyNet())
    state = TinyNet().state_dict()
    cases = {
        "missing": (
            {k: v for k, v in state.items() if k != "layers.2.bias"},
            r"1 name of the model not in the file: layers.2.bias",
        ),
        "extra": ({**state, "head.weight": torch.zeros(2)}, r"1 name in the file not in the model: head.weight"),
        "shape": (
            {**state, "layers.0.weight": torch.zeros(8, 7)},
            r"1 shape differing: layers.0.weight: file \[8, 7\], model \[8, 6\]",
        ),
    }
    for name, (bad, match) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(bad, str(path))
        with pytest.raises(ValueError, match=match):
            load_stage_weights(TinyNet(), path, spec)
        torch.save(bad, tmp_path / f"{name}.pt")
        with pytest.raises(ValueError, match=match):
            load_stage_weights(TinyNet(), tmp_path / f"{name}.pt", spec)


def test_unreadable_files_are_named(tmp_path: Path) -> None:
    for name in ("junk.pt", "junk.safetensors", "junk.ckpt"):
        (tmp_path / name).write_bytes(b"not weights at all")
        with pytest.raises(ValueError, match=rf"Cannot read the weights .*{name}"):
            open_weights(tmp_path / name)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list, not a state_dict"):
        open_weights(tmp_path / "list.pt")
    torch.save({"model": torch.nn.Linear(2, 2)}, tmp_path / "pickled.pt")  # not loadable with weights_only=True
    with pytest.raises(ValueError, match="Cannot read the weights"):
        open_weights(tmp_path / "pickled.pt")


def test_the_argument_is_checked_when_the_strategy_is_built(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="weights='.*nope.pt'.*no such file"):
        PipelineStrategy(weights=str(tmp_path / "nope.pt"))
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"unknown kind of file '.bin'. Valid: .pt, .pth, .ckpt, .safetensors"):
        PipelineStrategy(weights=str(tmp_path / "w.bin"))
    with pytest.raises(
        ValueError, match="neither a lightning-pipe checkpoint .* nor a Hugging Face save_pretrained directory"
    ):
        PipelineStrategy(weights=str(tmp_path))
    with pytest.raises(TypeError, match="give the path"):
        PipelineStrategy(weights=3)  # type: ignore[arg-type]
    (tmp_path / "w.pt").write_bytes(b"")
    assert check_weights_argument(str(tmp_path / "w.pt")) == tmp_path / "w.pt"


def test_a_bad_file_stops_every_rank_before_training(tmp_path: Path) -> None:
    state = start_weights()
    del state["layers.6.weight"]
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(Exception, match=r"1 name of the model not in the file: layers.6.weight"):
        fit_pipeline(DeferredNet(), 2, weights=str(tmp_path / "w.pt"))


def test_a_resumed_run_takes_the_checkpoint_over_the_weights(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_pipe.checkpoint import merged_state_dict
    from lightning_pipe.checkpoint import read as read_checkpoint

    class AtTrainStart(SaveStageState):  # after the checkpoint is restored (on_fit_start is before)
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            pass

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self._save(trainer, pl_module)

    saves = tmp_path / "saves"
    fit_pipeline(DeferredNet(), 2, max_steps=2, max_epochs=1, enable_checkpointing=True,
                 callbacks=[ModelCheckpoint(dirpath=str(saves), save_last=True)])  # fmt: skip
    saved = merged_state_dict(read_checkpoint(saves / "last.ckpt")[1])
    torch.save({k: torch.zeros_like(v) for k, v in saved.items()}, tmp_path / "zeros.pt")
    fit_pipeline(DeferredNet(), 2, weights=str(tmp_path / "zeros.pt"), ckpt_path=str(saves / "last.ckpt"), max_steps=3,
                 callbacks=[AtTrainStart(str(tmp_path), start=True)])  # fmt: skip
    start = merged_stage_states(str(tmp_path), 2, start=True)
    assert set(start) == set(saved)
    for name, value in saved.items():
        torch.testing.assert_close(start[name], value, rtol=0, atol=0, msg=name)


def test_a_safetensors_file_cut_at_its_tail_is_named(tmp_path: Path) -> None:
    """A shard whose copy or download stopped early: its header is whole, its data is not."""
    state = start_weights()
    names = list(state)
    save_pretrained_like(state, tmp_path / "sharded", [names[:4], names[4:]])
    cut = tmp_path / "sharded" / "model-00002-of-00002.safetensors"
    whole = cut.read_bytes()
    cut.write_bytes(whole[:-12])
    message = (
        rf"{cut} is cut short: its header describes {len(whole)} bytes, the file holds {len(whole) - 12}.*copy it again"
    )
    with pytest.raises(ValueError, match=message):
        load_stage_weights(built(DeferredNet()), tmp_path / "sharded", model_spec(built(DeferredNet())))
    single = tmp_path / "single.safetensors"
    single.write_bytes(whole[:-12])
    with pytest.raises(ValueError, match=rf"{single} is cut short"):
        open_weights(single)
