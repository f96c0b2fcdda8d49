"""A stage sharded over its replicas (``torch.distributed.checkpoint`` parts): its parts carry the
save tag and a checksum per file, and a part of another save, a changed, truncated or missing part
is refused naming it, as a stage file is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipe.checkpoint import consolidate, dcp_name, read
from tests.models import TinyNet
from tests.pipeline import fit_pipeline

pytestmark = pytest.mark.timeout(240)
SHARDED = {"stages": 1, "data_parallel": "shard", "chunks": 2}  # one stage over two replicas


def test_sharded_parts_of_another_save_or_damaged_are_refused_naming_them(tmp_path: Path) -> None:
    saves = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=2, filename="{step}")
    fit_pipeline(TinyNet(optimizer="adam"), 2, max_steps=4, enable_checkpointing=True, callbacks=[saves], **SHARDED)
    early, late = tmp_path / "step=2.ckpt", tmp_path / "step=4.ckpt"
    parts, other = late / dcp_name(0), early / dcp_name(0)
    whole = {f.name: f.read_bytes() for f in parts.iterdir()}
    assert sorted(whole) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    read(late)

    def put_back() -> None:
        shutil.rmtree(parts, ignore_errors=True)
        parts.mkdir()
        for name, data in whole.items():
            (parts / name).write_bytes(data)

    shutil.rmtree(parts)
    shutil.copytree(other, parts)  # the whole directory of the step-2 save
    with pytest.raises(
        RuntimeError,
        match=r"stage-00000.dcp belongs to the save of step 2 \(epoch 0\), but .*meta.pt to the save of step 4",
    ):
        consolidate(late)
    put_back()
    (parts / "__1_0.distcp").write_bytes((other / "__1_0.distcp").read_bytes())  # one part of it
    with pytest.raises(RuntimeError, match=r"stage-00000.dcp/__1_0.distcp (is damaged|belongs to the save of step 2)"):
        consolidate(late)
    put_back()
    (parts / "__0_0.distcp").write_bytes(whole["__0_0.distcp"][:100])
    with pytest.raises(
        RuntimeError,
        match=r"__0_0.distcp cannot be read: it has 100 bytes but was written with \d+; it is damaged or truncated",
    ):
        read(late)
    put_back()
    data = bytearray(whole["__1_0.distcp"])
    data[len(data) // 2] ^= 0xFF
    (parts / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(
        RuntimeError, match=r"stage-00000.dcp/__1_0.distcp is damaged: its content does not match the checksum"
    ):
        read(late)
    with pytest.raises(Exception, match=r"stage-00000.dcp/__1_0.distcp is damaged"):
        fit_pipeline(TinyNet(optimizer="adam"), 2, ckpt_path=str(late), max_steps=6, **SHARDED)
    put_back()
    (parts / "__0_0.distcp").unlink()
    with pytest.raises(FileNotFoundError, match=r"step=4.ckpt is incomplete: stage-00000.dcp/__0_0.distcp is missing"):
        read(late)
    shutil.rmtree(parts)
    with pytest.raises(FileNotFoundError, match=r"step=4.ckpt is incomplete: stage-00000.dcp is missing"):
        read(late)
    put_back()
    read(late)
