import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def fresh_main_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's launchers store the port they used in MASTER_PORT, so the next Trainer would reuse
    it while the last run's store may still hold it; every test gets a free port instead."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    monkeypatch.setenv("MASTER_PORT", str(find_free_network_port()))
