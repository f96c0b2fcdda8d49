"""Which tests start processes, found from their code: the ``processes`` marker is set on each at collection, so
``python -m pytest -m "not processes"`` runs the pure logic alone; a guard fails any unmarked test that starts one.

A test is marked when its function, a fixture it uses, or a function or class of this repository that they name
(the tests', the package's, the benchmarks'; followed through names and imports, as far as they go) names a process
starter: a ``Trainer`` (a pipeline's Trainer launches a process per device), ``subprocess``, ``multiprocessing`` or
torch's. A Trainer of one device starts none; such a test is marked all the same, as it is no pure logic either."""

from __future__ import annotations

import dis
import importlib
import importlib.util
import inspect
import multiprocessing.process
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: names that start processes when called (or modules whose use does)
STARTER_NAMES = frozenset(
    {"Trainer", "Popen", "spawn", "start_processes", "fit_pipeline", "pipeline_trainer", "fabric_pipeline_run"}
)
STARTER_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing"})
MARKER = "processes"


ROOT = Path(__file__).resolve().parents[1]


def _ours(obj: Any) -> bool:
    """Whether ``obj`` is defined in this repository (the tests, the package, the benchmarks), not in a library."""
    try:
        path = Path(inspect.getfile(obj)).resolve()
    except (TypeError, OSError):
        return False
    return path.is_relative_to(ROOT) and ".venv" not in path.relative_to(ROOT).parts


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _imported_inside(code: types.CodeType, names: set[str]) -> dict[str, Any]:
    """What the function imports in its body from this repository (``from lightning_pipe.cli import run``, ``import
    activation_memory``): by the names it binds, a module's members too where the code names them."""
    found: dict[str, Any] = {}
    codes = [code]
    while codes:
        current = codes.pop()
        codes.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
        module = None
        for instruction in dis.get_instructions(current):
            if instruction.opname == "IMPORT_NAME":
                module = _our_module(str(instruction.argval))
                if module is not None:
                    found[str(instruction.argval).split(".")[0]] = module
                    found.update({n: getattr(module, n) for n in names if hasattr(module, n)})
            elif instruction.opname == "IMPORT_FROM" and module is not None and hasattr(module, instruction.argval):
                found[str(instruction.argval)] = getattr(module, str(instruction.argval))
    return found


def _our_module(name: str) -> types.ModuleType | None:
    """The module ``name`` where it is this repository's own (imported to read it), else None."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    if not origin or not Path(origin).resolve().is_relative_to(ROOT) or ".venv" in Path(origin).parts:
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # a module that cannot be imported here starts nothing from here
        return None


def _starts(obj: Any, seen: dict[int, bool]) -> bool:
    """Whether ``obj`` (a function or a class of the tests) names a starter, directly or through the tests'
    own functions and classes that it names."""
    key = id(obj)
    if key in seen:
        return seen[key]
    seen[key] = False  # a cycle adds nothing
    if inspect.isclass(obj):
        members = [m for m in vars(obj).values() if inspect.isfunction(m)]
        seen[key] = any(_starts(m, seen) for m in members)
        return seen[key]
    func = inspect.unwrap(obj)
    code = getattr(func, "__code__", None)
    if code is None:
        return False
    names = _code_names(code)
    if names & STARTER_NAMES:
        seen[key] = True
        return True
    scope = dict(getattr(func, "__globals__", {}))
    scope.update(_imported_inside(code, names))
    for name in names:
        value = scope.get(name)
        if isinstance(value, types.ModuleType):
            if value.__name__ in STARTER_MODULES:
                seen[key] = True
                return True
            continue
        if (inspect.isfunction(value) or inspect.isclass(value)) and _ours(value) and _starts(value, seen):
            seen[key] = True
            return True
    return False


def starts_processes(item: pytest.Item, seen: dict[int, bool]) -> bool:
    """Whether ``item``'s test function or one of its fixtures may start processes."""
    function = getattr(item, "function", None)
    if function is None:
        return False
    if _starts(function, seen):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info is not None else ():
        for fixture in defs:
            if fixture.func is _GUARD:
                continue
            if _ours(fixture.func) and _starts(fixture.func, seen):
                return True
    return False


def mark(items: list[pytest.Item]) -> None:
    seen: dict[int, bool] = {}
    for item in items:
        if starts_processes(item, seen):
            item.add_marker(MARKER)


class ProcessStarted(AssertionError):
    """An unmarked test started a process: the marker's search missed what it called."""


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In a test without the marker, starting a process fails the test, naming the fix: the marker stays true."""
    if request.node.get_closest_marker(MARKER) is not None:
        yield
        return

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ProcessStarted(
            f"{request.node.nodeid} starts a process, but tests/processes.py did not mark it '{MARKER}': add the "
            "name of what it calls to STARTER_NAMES there"
        )

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield


_GUARD = inspect.unwrap(_unmarked_tests_start_no_process)
