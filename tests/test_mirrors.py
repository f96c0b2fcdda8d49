"""Tests a reader can find: each module of the package has its test at the mirrored path
(``lightning_pipe/a/b.py``: ``tests/a/test_b.py``), or an entry below naming the test files that exercise it,
and no test file sits at the top of ``tests/`` unless it mirrors a top-level module or speaks of the project
as a whole."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE, TESTS = ROOT / "lightning_pipe", ROOT / "tests"

#: modules whose behaviour is exercised through a neighbour's tests rather than a file of their own
COVERED_BY: dict[str, tuple[str, ...]] = {
    "checkpoint/cli": ("checkpoint/test_files.py",),
    "checkpoint/consolidate": ("checkpoint/test_files.py", "checkpoint/test_optimizer_state.py"),
    "checkpoint/merged": ("runtime/replicas/test_elastic_averaging.py",),
    "checkpoint/newest": ("trainer/launch/test_restarts.py",),
    "checkpoint/stage_io": ("trainer/test_faults.py",),
    "checkpoint/staging": ("trainer/launch/test_restarts.py",),
    "checkpoint/tags": ("trainer/launch/test_restarts.py",),
    "command_keys": ("test_command.py",),
    "observe/picture": ("observe/test_timeline_image.py",),
    "partition/measure/measured": ("partition/solvers/test_rank_order.py",),
    "partition/solvers/costs": ("partition/measure/test_profile.py",),
    "partition/stages/ends": ("partition/stages/test_end_trace.py", "partition/stages/test_own_model_ends.py"),
    "plan/auto": ("plan/test_planner.py",),
    "runtime/activations/meter": ("plan/test_activation_prediction.py",),
    "runtime/activations/policy": ("runtime/activations/test_offload.py",),
    "runtime/asynchronous/rising_loss": ("runtime/asynchronous/test_delay_correction.py",),
    "runtime/crossing/records": ("runtime/crossing/test_carried.py",),
    "runtime/crossing/skips": ("test_skips.py",),
    "runtime/grads/deferred_conv": ("runtime/grads/test_split_backward.py",),
    "runtime/grads/weight_store": (
        "runtime/grads/test_split_backward.py",
        "runtime/grads/test_zero_bubble_training.py",
    ),
    "runtime/options": ("runtime/test_pipeline.py", "test_resolve.py"),
    "runtime/replicas/pending": ("runtime/replicas/test_data_parallel_lifecycle.py",),
    "runtime/crossing/wire": ("runtime/test_p2p.py", "runtime/crossing/test_seam.py"),
    "runtime/crossing/skip_mail": ("test_skips.py", "runtime/crossing/test_seam.py"),
    "schedules/actions": ("schedules/test_properties.py",),
    "schedules/comm": ("schedules/test_properties.py",),
    "schedules/families/asynchronous": ("runtime/test_async_pipeline.py",),
    "schedules/families/interleaved": ("schedules/families/test_zero_bubble.py",),
    "schedules/render": ("schedules/test_text.py",),
    "schedules/runnable": ("schedules/test_rendezvous.py",),
    "schedules/simulate": ("schedules/test_properties.py",),
    "schedules/validate": ("schedules/test_properties.py",),
    "trainer/compatibility": ("trainer/test_errors.py", "trainer/test_preflight.py"),
    "trainer/dataloaders/loaders": ("trainer/dataloaders/test_replica_data.py",),
    "trainer/internals": ("test_imports.py",),
    "trainer/launch/processes": ("trainer/launch/test_launcher.py",),
    "trainer/layout_report": ("observe/test_run_report.py",),
    "trainer/nothing_to_train": ("runtime/grads/test_frozen.py",),
    "trainer/precision": ("trainer/test_lifecycle.py",),
    "trainer/reductions": ("trainer/test_lifecycle.py",),
    "trainer/stage_setup": ("trainer/test_preflight.py", "trainer/launch/test_restarts.py", "test_strategy.py"),
    "trainer/steps": ("trainer/test_faults.py",),
    "weights/hf_conversion": ("runtime/blocks/test_hf_families.py",),
}

#: test files at the top of tests/ that mirror no module: they check the project as a whole
PROJECT_WIDE = {
    "test_benchmarks.py": "the benchmarks' arithmetic (benchmarks/ is beside the package)",
    "test_docs.py": "the guide's pages",
    "test_gpu.py": "the tests that need a GPU",
    "test_imports.py": "the package's import layers",
    "test_mirrors.py": "this file",
    "test_packaging.py": "the wheel",
    "test_readme.py": "the README's examples",
}


def _modules() -> list[str]:
    names = (p.relative_to(PACKAGE).with_suffix("").as_posix() for p in PACKAGE.rglob("*.py"))
    return sorted(n for n in names if Path(n).name not in ("__init__", "__main__"))


def _mirror(module: str) -> Path:
    path = Path(module)
    return TESTS / path.parent / f"test_{path.name}.py"


def test_every_module_has_its_mirrored_test_or_names_the_tests_that_cover_it() -> None:
    modules = _modules()
    assert len(modules) > 100, modules  # the package was found
    missing = [m for m in modules if not _mirror(m).exists() and m not in COVERED_BY]
    assert not missing, f"add tests/<path>/test_<module>.py for these, or an entry in COVERED_BY: {missing}"
    stale = [m for m in COVERED_BY if m not in modules or _mirror(m).exists()]
    assert not stale, f"these COVERED_BY entries are gone or now have their mirrored test; remove them: {stale}"
    absent = [(m, t) for m, tests in COVERED_BY.items() for t in tests if not (TESTS / t).exists()]
    assert not absent, f"COVERED_BY names test files that do not exist: {absent}"


def test_no_test_file_sits_at_the_top_unless_it_mirrors_a_top_level_module_or_the_project() -> None:
    top_level = {f"test_{m}.py" for m in _modules() if "/" not in m}
    flat = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert "test_config.py" in flat and "test_docs.py" in flat
    stray = [name for name in flat if name not in top_level and name not in PROJECT_WIDE]
    assert not stray, f"move these into the folder of the package part they test (tests/<path>/): {stray}"
