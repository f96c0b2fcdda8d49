import hashlib
import io
import pickle
import tarfile
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pipe.recipes.vgg import CIFAR100Data, load_cifar100_split, prepare_cifar100, synthetic_images, vgg_layers


def test_vgg19_shapes_and_layers() -> None:
    for batch_norm in (True, False):
        layers = vgg_layers(19, batch_norm=batch_norm, num_classes=100, width=0.25)
        assert sum(isinstance(m, nn.Conv2d) for m in layers) == 16
        assert sum(isinstance(m, nn.BatchNorm2d) for m in layers) == (16 if batch_norm else 0)
        assert layers(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    full = vgg_layers(19)
    assert 20_000_000 < sum(p.numel() for p in full.parameters()) < 21_000_000  # VGG19 for CIFAR-100
    with pytest.raises(ValueError, match="depth must be one of"):
        vgg_layers(20)


def _write_archive(root: Path, n_train: int = 20, n_test: int = 10) -> Path:
    """A CIFAR-100 python archive in the real format, with random content."""
    g = torch.Generator().manual_seed(0)

    def entry(n: int) -> bytes:
        data = torch.randint(0, 256, (n, 3072), generator=g, dtype=torch.uint8).numpy()
        fine = torch.randint(0, 100, (n,), generator=g).tolist()
        return pickle.dumps({b"data": data, b"fine_labels": fine, b"coarse_labels": [f // 5 for f in fine],
                             b"filenames": [b"x.png"] * n, b"batch_label": b"training batch 1 of 1"})  # fmt: skip

    archive = root / "cifar-100-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, payload in (
            ("train", entry(n_train)),
            ("test", entry(n_test)),
            ("meta", pickle.dumps({b"fine_label_names": []})),
        ):
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return archive


def test_cifar100_archive_is_extracted_and_read(tmp_path: Path) -> None:
    archive = _write_archive(tmp_path)
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    folder = prepare_cifar100(tmp_path, md5=md5)
    images, labels = load_cifar100_split(folder, train=True)
    assert images.shape == (20, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.shape == (20,) and int(labels.min()) >= 0 and int(labels.max()) < 100
    with open(folder / "train", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    assert torch.equal(images.reshape(20, -1), torch.as_tensor(raw[b"data"]))  # channel-first rows, as documented


def test_cifar100_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="recipe.data.source=synthetic"):
        prepare_cifar100(tmp_path / "empty")
    _write_archive(tmp_path)
    with pytest.raises(RuntimeError, match="MD5 mismatch"):
        prepare_cifar100(tmp_path)  # the real archive's checksum


def test_datamodule_on_the_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = _write_archive(tmp_path)
    monkeypatch.setattr("lightning_pipe.recipes.vgg.CIFAR100_MD5", hashlib.md5(archive.read_bytes()).hexdigest())
    data = CIFAR100Data(source="cifar100", root=str(tmp_path), batch_size=8)
    data.prepare_data()
    data.setup()
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (8,)
    assert abs(float(x.mean())) < 1.0  # normalised


def test_synthetic_source_is_learnable_and_fixed() -> None:
    a, la = synthetic_images(64, 10, seed=0)
    b, lb = synthetic_images(64, 10, seed=0)
    assert torch.equal(a, b) and torch.equal(la, lb)
    # same-class images are closer to each other than to other classes
    x = a.float().flatten(1)
    same = [(x[i] - x[j]).norm() for i in range(20) for j in range(20) if i < j and la[i] == la[j]]
    other = [(x[i] - x[j]).norm() for i in range(20) for j in range(20) if i < j and la[i] != la[j]]
    assert same and sum(same) / len(same) < sum(other) / len(other)


def test_augmentation_is_a_function_of_the_sample_and_the_epoch() -> None:
    """Two datasets (two stages, or a resumed process) give the same crops for an epoch whatever they read
    before; the next epoch crops differently."""
    from lightning_pipe.recipes import EpochShuffle
    from lightning_pipe.recipes.vgg import CIFAR100_MEAN, CIFAR100_STD, AugmentedImages, synthetic_images

    images, labels = synthetic_images(8, 10, seed=0)
    a = AugmentedImages(images, labels, augment=True, mean=CIFAR100_MEAN, std=CIFAR100_STD)
    b = AugmentedImages(images, labels, augment=True, mean=CIFAR100_MEAN, std=CIFAR100_STD)
    for i in range(8):
        a[i]  # epoch 0, read by a only
    EpochShuffle(a).set_epoch(1)  # what Lightning calls at each epoch's start
    EpochShuffle(b).set_epoch(1)
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(8))
    first = [a[i][0] for i in range(8)]
    a.set_epoch(2)
    assert any(not torch.equal(a[i][0], first[i]) for i in range(8))


def test_the_recipes_training_loader_is_one_the_pipeline_steers() -> None:
    """VGG's and BERT's data modules (``TrainValData``): the pipeline replaces their ``EpochShuffle`` by its
    own order (the same permutation: the seed and the epoch), splits it over replicas and resumes it in the
    middle of an epoch; the epoch still reaches the dataset's ``set_epoch`` (VGG's crops)."""
    from lightning_pipe.recipes import EpochShuffle, TrainValData
    from lightning_pipe.trainer.dataloaders.replica_data import ReplicaOrder, not_steered

    class Epochs(torch.utils.data.TensorDataset):
        epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    data = TrainValData()
    data.batch_size, data.num_workers, data.train = 4, 0, Epochs(torch.arange(20))
    loader = data.train_dataloader()
    assert not_steered(loader) is None
    user = loader.sampler
    assert isinstance(user, EpochShuffle)
    order = ReplicaOrder(data.train, 1, 0, True, user.seed, replaced=user)
    order.set_epoch(3)
    assert data.train.epoch == 3 and list(order) == list(user)  # EpochShuffle's own order for the epoch
