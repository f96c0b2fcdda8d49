"""Reading a checkpoint directory: every tensor is compared with the checksum recorded when it was
written, so damaged bytes stop a consolidation, a resume and ``weights=``, naming the file; a rank
compares only the tensors it uses."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe.checkpoint import consolidate, read, shard_name, write_meta, write_shard
from lightning_pipe.checkpoint import main as consolidate_main
from tests.models import TinyNet
from tests.pipeline import fit_pipeline

pytestmark = pytest.mark.timeout(240)


def flip(file: Path, tensor: torch.Tensor) -> None:
    """Invert 8 bytes inside ``tensor``'s data where ``file`` stores it."""
    data = bytearray(file.read_bytes())
    at = data.find(tensor.numpy().tobytes())
    assert at >= 0 and data.find(tensor.numpy().tobytes(), at + 1) < 0
    data[at + 8 : at + 16] = bytes(b ^ 0xFF for b in data[at + 8 : at + 16])
    file.write_bytes(bytes(data))


def test_damaged_metadata_and_shards_written_without_processes_are_refused(tmp_path: Path) -> None:
    tag = {"token": "t", "global_step": 3, "epoch": 0}
    state = TinyNet().state_dict()
    write_shard(tmp_path, 0, state, None, tag=tag)
    best = torch.arange(16, dtype=torch.float32)
    write_meta(tmp_path, {"epoch": 0, "callbacks": {"ModelCheckpoint": {"best_model_score": best}}}, 1, tag)
    read(tmp_path)
    flip(tmp_path / "meta.pt", best)
    with pytest.raises(
        RuntimeError, match=r"meta.pt is damaged: the tensor callbacks/ModelCheckpoint/best_model_score"
    ):
        read(tmp_path)
    write_meta(tmp_path, {"epoch": 0}, 1, tag)
    flip(tmp_path / shard_name(0), state["layers.2.bias"])
    read(tmp_path, names=["layers.0.weight"])  # another stage's tensor: not read, not compared
    with pytest.raises(
        RuntimeError, match=r"stage-00000.pt is damaged: the tensor state_dict/layers.2.bias does not match"
    ):
        read(tmp_path, names=["layers.2.bias"])


def test_a_folder_that_is_not_a_checkpoint_is_refused_saying_what_a_checkpoint_folder_holds(tmp_path: Path) -> None:
    """``fit(ckpt_path=)`` (the strategy's load, which hands a path that is not a pipeline checkpoint
    to Lightning's loader) and ``read`` (consolidation, ``weights=``): a folder without ``meta.pt``
    is named as such, with what a checkpoint folder holds and the checkpoints found inside it;
    one with stage files but no ``meta.pt`` as an incomplete save."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_pipe.trainer.checkpoint_hooks import load_checkpoint

    def resume(path: Path) -> None:
        load_checkpoint(TinyNet(), path, None, lambda p, _: TorchCheckpointIO().load_checkpoint(p))

    folder = tmp_path / "run"
    (folder / "checkpoints" / "last.ckpt").mkdir(parents=True)
    write_shard(folder / "checkpoints" / "last.ckpt", 0, TinyNet().state_dict(), None, tag={"token": "t"})
    write_meta(folder / "checkpoints" / "last.ckpt", {"epoch": 0}, 1, {"token": "t"})
    (folder / "epoch=0-step=3.ckpt").write_bytes(b"")
    holds = r"is a folder, not a checkpoint: a lightning-pipe checkpoint is a folder holding meta.pt and one stage-"
    found = r"Checkpoints in it: epoch=0-step=3.ckpt, checkpoints/last.ckpt\. Give the path of a checkpoint"
    for refused in (resume, read):
        with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(folder))} {holds}.* {found}"):
            refused(folder)
    (folder / "checkpoints" / "last.ckpt" / "meta.pt").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"last.ckpt is an incomplete checkpoint: it has stage-00000.pt but no "
    ):
        resume(folder / "checkpoints" / "last.ckpt")
    with pytest.raises(FileNotFoundError, match=r"empty is a folder, not a checkpoint: .*stage.*\.ckpt file\. Give"):
        (tmp_path / "empty").mkdir()
        resume(tmp_path / "empty")


def test_damaged_bytes_stop_consolidation_resume_and_weights_naming_the_file(tmp_path: Path) -> None:
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(TinyNet(optimizer="adam"), 2, chunks=3, max_steps=2, enable_checkpointing=True, callbacks=[saves])
    last = tmp_path / "last.ckpt"
    shard = last / shard_name(1)
    whole = shard.read_bytes()
    stored = torch.load(shard, weights_only=True)
    flip(shard, stored["state_dict"]["layers.7.weight"])
    message = re.escape(str(shard)) + r" is damaged: the tensor state_dict/layers.7.weight does not match the checksum"
    with pytest.raises(RuntimeError, match=message):
        consolidate(last)
    with pytest.raises(RuntimeError, match=message):
        consolidate_main([str(last), str(tmp_path / "plain.ckpt")])
    assert not (tmp_path / "plain.ckpt").exists()
    with pytest.raises(Exception, match=message):
        fit_pipeline(TinyNet(optimizer="adam"), 2, ckpt_path=str(last), chunks=3, max_steps=4)
    with pytest.raises(Exception, match=message):
        fit_pipeline(TinyNet(), 2, weights=str(last), chunks=3, max_steps=1)
    # the optimizer state too, compared by the rank that holds it only
    shard.write_bytes(whole)
    flip(shard, stored["optimizer_states"][0]["state"]["layers.6.weight"]["exp_avg_sq"])
    stage_zero = [n for n in TinyNet().state_dict() if int(n.split(".")[1]) < 4]
    read(last, names=stage_zero)
    with pytest.raises(
        RuntimeError, match=r"the tensor optimizer_states/0/state/layers.6.weight/exp_avg_sq does not match"
    ):
        read(last)


def _two_stages(path: Path, momentum: tuple[float, float] = (0.9, 0.9)) -> None:
    """A two-stage checkpoint written without processes, SGD with ``momentum`` saved per stage."""
    tag = {"token": "t", "global_step": 3, "epoch": 0}
    state = TinyNet().state_dict()
    names = list(state)
    for stage, m in enumerate(momentum):
        mine = names[: len(names) // 2] if stage == 0 else names[len(names) // 2 :]
        group = {"lr": 0.1, "momentum": m, "dampening": 0, "weight_decay": 0, "nesterov": False, "params": mine}
        optim = [{"state": {n: {"momentum_buffer": torch.ones(2)} for n in mine}, "param_groups": [group]}]
        write_shard(
            path, stage, {n: state[n] for n in mine}, optim, extra={"async": {"step": 7, "pending": {}}}, tag=tag
        )
    sched = {"gamma": 0.5, "base_lrs": [0.1], "last_epoch": 3}
    write_meta(path, {"epoch": 0, "global_step": 3, "lr_schedulers": [sched]}, 2, tag)


def flip_float(file: Path, value: float, new: float) -> None:
    """Change the one pickled ``value`` in ``file`` to ``new`` by a single byte (0.9 -> 0.775)."""
    old_bytes, new_bytes = struct.pack(">d", value), struct.pack(">d", new)
    assert sum(a != b for a, b in zip(old_bytes, new_bytes)) == 1
    data = file.read_bytes()
    assert data.count(old_bytes) == 1
    file.write_bytes(data.replace(old_bytes, new_bytes))


@pytest.mark.parametrize("stage", [0, 1])
def test_a_changed_optimizer_hyperparameter_is_refused_naming_the_file(tmp_path: Path, stage: int) -> None:
    _two_stages(tmp_path)
    assert read(tmp_path)[1][stage]["optimizer_states"][0]["param_groups"][0]["momentum"] == 0.9
    flip_float(tmp_path / shard_name(stage), 0.9, 0.775)
    message = (
        re.escape(str(tmp_path / shard_name(stage)))
        + r" is damaged: its values other than tensors under optimizer_states \(hyper-parameters"
    )
    with pytest.raises(RuntimeError, match=message):
        read(tmp_path)
    with pytest.raises(RuntimeError, match=message):
        read(tmp_path, names=["layers.0.weight"])  # every rank checks every stage's hyperparameters


def test_a_changed_scheduler_value_in_the_metadata_is_refused(tmp_path: Path) -> None:
    _two_stages(tmp_path)
    flip_float(tmp_path / "meta.pt", 0.5, 0.75)
    with pytest.raises(RuntimeError, match=r"meta.pt is damaged: its values other than tensors under lr_schedulers"):
        read(tmp_path)


def test_stages_that_saved_different_hyperparameters_are_refused_naming_both_files(tmp_path: Path) -> None:
    _two_stages(tmp_path, momentum=(0.9, 0.8))  # each file whole, but they disagree
    message = (
        re.escape(str(tmp_path / shard_name(1))) + r" saved other optimizer hyperparameters than "
        + re.escape(str(tmp_path / shard_name(0))) + r" \(optimizer 0, parameter group 0: momentum 0.8 against 0.9\)"
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=message):
        read(tmp_path)


def test_a_resume_refuses_a_momentum_changed_in_either_stage_file(tmp_path: Path) -> None:
    saves = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    fit_pipeline(TinyNet(), 2, chunks=3, max_steps=2, enable_checkpointing=True, callbacks=[saves])
    last = tmp_path / "last.ckpt"
    for stage in (0, 1):
        shard = last / shard_name(stage)
        whole = shard.read_bytes()
        flip_float(shard, 0.9, 0.775)
        message = re.escape(str(shard)) + r" is damaged: its values other than tensors under optimizer_states"
        with pytest.raises(Exception, match=message):
            fit_pipeline(TinyNet(), 2, ckpt_path=str(last), chunks=3, max_steps=4)
        shard.write_bytes(whole)


def test_a_stage_file_of_another_run_at_the_same_step_is_named_by_its_save_id(tmp_path: Path) -> None:
    state = TinyNet().state_dict()
    for run, token in (("a", "1f2e3d4c5b6a"), ("b", "9a8b7c6d5e4f")):
        tag = {"token": token, "global_step": 4, "epoch": 0}
        (tmp_path / run).mkdir()
        write_shard(tmp_path / run, 0, state, None, tag=tag)
        write_meta(tmp_path / run, {"epoch": 0, "global_step": 4}, 1, tag)
    (tmp_path / "a" / shard_name(0)).write_bytes((tmp_path / "b" / shard_name(0)).read_bytes())
    message = (
        re.escape(str(tmp_path / "a" / shard_name(0))) + r" belongs to another save at the same step 4 \(epoch 0\) "
                                                         r"than "
        + re.escape(str(tmp_path / "a" / "meta.pt")) + r": save id 9a8b7c6d against 1f2e3d4c \(another run, or the "
                                                       r"same step saved twice\)"
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=message):
        read(tmp_path / "a")
