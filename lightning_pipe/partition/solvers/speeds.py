"""Unequal devices: each rank's speed and free memory, and splits that give a slower or smaller
device less work (HetPipe's idea, for one pipeline's contiguous split).

Pure arithmetic first (numbers in, layer counts out, tested without processes), then the two
measurements a rank takes of itself (:func:`probe_timings`, :func:`free_bytes`). Nothing here is
distributed: the caller gathers every rank's numbers and hands them in.

A speed is relative: a stage of cost ``c`` (seconds as the profiling rank measured them) takes
``c / speed`` on its rank. The split minimises the slowest stage's ``sum of costs / speed``
exactly (the same dynamic programme as :func:`~lightning_pipe.partition.solvers.balance.balance_by_cost`);
with memory, each stage's bytes over its rank's free bytes. Where every rank is as fast (within
:data:`EQUAL_WITHIN`, or within the spread of the probe's repeats on a noisy host: see
:func:`speeds_from_timings`), the split is today's, unchanged.
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from lightning_pipe.partition.solvers.balance import Owners, balance_by_cost, balance_by_stage_cost

#: speeds (or capacities) whose largest is within this share of their smallest count as equal: the
#: probe's spread between two idle, equal devices (and between repeats on one) is of this order
EQUAL_WITHIN = 0.10


def check_rank_speeds(speeds: Any) -> list[float] | None:
    """``rank_speeds`` as Python floats: any sequence or 1-D array of positive finite real numbers
    (numpy's and torch's too), or None; otherwise refused."""
    if speeds is None:
        return None
    values = None if isinstance(speeds, (str, bytes, Mapping)) or not isinstance(speeds, Iterable) else list(speeds)
    reals = [_real(s) for s in values or []]
    if not reals or any(r is None or not math.isfinite(r) or r <= 0 for r in reals):
        raise ValueError(
            f"PipelineStrategy(rank_speeds={speeds!r}): give one positive number per process, its relative speed "
            "(such as [1.0, 0.5] where rank 1 runs at half the speed of rank 0), or None to measure them."
        )
    return [r for r in reals if r is not None]


def _real(value: Any) -> float | None:
    """``value`` as a float where it is a real number of any kind (Python's, a numpy scalar, a torch
    tensor of one element); None for anything else, truth values included."""
    kind = str(getattr(value, "dtype", ""))
    if isinstance(value, (bool, str, bytes)) or "bool" in kind or "complex" in kind:
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if kind and tuple(getattr(value, "shape", (0,))) in ((), (1,)):
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def check_speeds_for_world(speeds: Sequence[float], world_size: int) -> list[float]:
    """``speeds`` as floats, one per process of a world of ``world_size``."""
    if len(speeds) != world_size:
        raise ValueError(
            f"PipelineStrategy(rank_speeds={list(speeds)!r}) gives {len(speeds)} speeds for {world_size} processes: "
            f"give one per process (global rank 0 first), {world_size} in all, or None to measure them."
        )
    return [float(s) for s in speeds]


def all_equal(values: Sequence[float] | None, within: float = EQUAL_WITHIN) -> bool:
    """Whether ``values`` are equal for the split's purpose (None and unknown entries: yes)."""
    if not values or any(v is None for v in values):
        return True
    return max(values) <= (1.0 + within) * min(values)


def relative(values: Sequence[float], to: int = 0) -> list[float]:
    """``values`` divided by entry ``to``'s (the profiling rank's speed becomes 1.0)."""
    return [float(v) / float(values[to]) for v in values]


def speeds_from_seconds(seconds: Sequence[float]) -> list[float]:
    """Relative speeds from each rank's seconds on the same probe (the fastest rank is 1.0)."""
    fastest = min(seconds)
    return [fastest / s for s in seconds]


def _quartiles(times: Sequence[float]) -> tuple[float, float, float]:
    """Lower quartile, median and upper quartile of ``times`` (one value: itself three times)."""
    if len(times) < 2:
        return (float(times[0]),) * 3
    low, median, high = statistics.quantiles(times, n=4, method="inclusive")
    return low, median, high


def speeds_from_timings(timings: Sequence[Sequence[float]], within: float = EQUAL_WITHIN) -> list[float]:
    """Relative speeds (the fastest 1.0) from each rank's repeated probe seconds, robust to a noisy host.

    Each rank's time is the median of its repeats, and ranks the measurement cannot tell apart count as
    equal: taken from the fastest, a rank joins the group of the first (fastest) rank of a group when its
    lower quartile is within ``within`` of that rank's upper quartile, that is when the two spreads
    overlap (give or take ``within``, the spread between two idle, equal devices). Every rank of a
    group gets the group's median time. So two equal cores, one of them briefly shared with another
    process during the probe, come out equal, and only a difference larger than the noise moves work."""
    stats = [_quartiles(times) for times in timings]
    by_time = sorted(range(len(timings)), key=lambda r: stats[r][1])
    groups: list[list[int]] = []
    for rank in by_time:
        if groups and stats[rank][0] <= (1.0 + within) * stats[groups[-1][0]][2]:
            groups[-1].append(rank)
        else:
            groups.append([rank])
    seconds = [0.0] * len(timings)
    for group in groups:
        for rank in group:
            seconds[rank] = statistics.median(stats[r][1] for r in group)
    return speeds_from_seconds(seconds)


def position_values(per_rank: Sequence[float], stages: int, replicas: int, order: Sequence[int] = ()) -> list[float]:
    """Per pipeline position, the least of its replicas' values (position ``p`` is held by the ranks
    of slots ``p x replicas ..``, rank ``order[slot]``, by default rank ``slot``; see
    :class:`~lightning_pipe.runtime.topology.Layout`): replicas of a position hold the same stages
    and step together, so the slowest (or smallest) bounds them."""
    if len(per_rank) != stages * replicas:
        raise ValueError(f"{len(per_rank)} values for {stages} x {replicas} processes")
    ranks = list(order) or list(range(stages * replicas))
    return [min(per_rank[r] for r in ranks[p * replicas : (p + 1) * replicas]) for p in range(stages)]


def stage_values(per_position: Sequence[float], positions: Sequence[int], num_split: int) -> list[float]:
    """Per stage of the split, the value of the position holding it (``positions[s]``, see
    :func:`~lightning_pipe.schedules.stage_positions`); a stage kept twice (Chimera's copies, at
    ``s`` and ``s + num_split``) takes the lesser of its two holders."""
    out = [math.inf] * num_split
    for stage, position in enumerate(positions):
        out[stage % num_split] = min(out[stage % num_split], float(per_position[position]))
    return out


def balance_by_speed(costs: Sequence[float], speeds: Sequence[float], owners: Owners = None) -> list[int]:
    """Contiguous split of layers costing ``costs`` (seconds on a speed-1.0 device) over stages of
    ``speeds``, minimising the slowest stage's ``sum(costs) / speed`` exactly; ties broken as in
    :func:`balance_by_cost`. Speeds equal within :data:`EQUAL_WITHIN` give :func:`balance_by_cost`'s split."""
    if any(not s > 0 for s in speeds):
        raise ValueError(f"stage speeds must be positive, got {list(speeds)}")
    if all_equal(speeds):
        return balance_by_cost(costs, len(speeds), owners)
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be non-negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    top = max(speeds)
    scale = [top / s for s in speeds]  # 1.0 for the fastest: its stage's cost is as measured
    return balance_by_stage_cost(len(costs), len(speeds), lambda s, j, i: (prefix[i] - prefix[j]) * scale[s], owners)


def bottleneck(costs: Sequence[float], balance: Sequence[int], speeds: Sequence[float]) -> float:
    """The slowest stage's seconds, ``sum(costs) / speed``, of ``balance`` over stages of ``speeds``."""
    out, start = 0.0, 0
    for count, speed in zip(balance, speeds):
        out = max(out, sum(costs[start : start + count]) / speed)
        start += count
    return out


def probe_timings(device: torch.device, repeats: int = 9) -> list[float]:
    """Seconds of each of ``repeats`` runs of a fixed workload on ``device`` (after a warm-up): matrix
    products as one layer's forward and backward run them (three per iteration), long enough (half of
    the 80 iterations that took 60 to 80 ms on one core of the project's test machine) that a core shared
    with another process shows its share, not one uninterrupted time slice, and repeated so that
    :func:`speeds_from_timings` sees the noise. Leaves the random state as it was (its inputs have their
    own generator)."""
    cuda = device.type == "cuda"
    size, iterations = (4096, 4) if cuda else (256, 40)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device)
    w = torch.randn(size, size, generator=generator).to(device)
    h, g, dw = (torch.empty(size, size, device=device) for _ in range(3))
    times = []
    for rep in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(iterations):
            torch.mm(a, w, out=h)  # forward
            torch.mm(h, w.t(), out=g)  # input gradient
            torch.mm(a.t(), h, out=dw)  # weight gradient
        if cuda:
            torch.cuda.synchronize(device)
        if rep > 0:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return times


def free_bytes(device: torch.device) -> int | None:
    """Bytes free for this rank's stages: the GPU's free memory, or on a CPU the host's available
    memory (``MemAvailable`` of ``/proc/meminfo``; None where it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
