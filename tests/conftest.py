import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from lightning_pipe.runtime.topology import Topology

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core up to 4; each multi-process test starts 2 to 4 processes itself."""
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_report_header(config: pytest.Config) -> str:
    """The conformance matrix's selection (tests/conformance): fixed unless a variable asks for another."""
    from tests.conformance.axes import CELL_VARIABLE, FIXED_SEED, default_seed

    seed = default_seed()
    which = "the fixed pair cover" if seed == FIXED_SEED else f"the pair cover of seed {seed}"
    return f"conformance matrix: {which} (one cell: {CELL_VARIABLE}=schedule/event/layout/model)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.processes import mark

    mark(items)  # "processes": the tests that start processes (-m "not processes": the pure logic alone)
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


from tests.processes import _unmarked_tests_start_no_process  # noqa: E402,F401  (autouse: the marker stays true)


@pytest.fixture(autouse=True)
def fresh_main_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's launchers store the port they used in MASTER_PORT, so the next Trainer would reuse
    it while the last run's store may still hold it; every test gets a free port instead."""
    from tests.ports import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator["Topology"]:
    """A gloo process group of the test process alone, with its topology (one stage, one replica),
    for driving the pipeline's parts without a Trainer. Destroyed with the module's tests: the
    processes later tests start must not inherit it."""
    import torch.distributed as dist

    from lightning_pipe.runtime.topology import Layout, Topology

    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield Topology(Layout(1, 1), 0, "cpu")
    finally:
        dist.destroy_process_group()
