"""Assign contiguous layers to stages. Pure functions over cost lists, as in torchgpipe's
``balance`` package: the solvers see numbers, not modules."""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: ``stage_cost(stage, start, stop)``: the cost of stage ``stage`` holding layers ``start..stop-1``.
StageCost = Callable[[int, int, int], float]
#: per layer, whether it holds a parameter. A stage of parameter-free layers alone (a lone ``ReLU``)
#: would give its process's optimizer an empty parameter list, so the solvers keep one out of reach
#: where the layers allow it (:func:`owning`).
Owners = Sequence[bool] | None


def owning(owners: Owners, num_stages: int) -> Owners:
    """``owners`` if every stage can be given a layer that holds a parameter, else None (no constraint:
    :func:`stages_without_parameters` then names what the split lacks)."""
    if owners is None or sum(bool(o) for o in owners) < num_stages:
        return None
    return owners


def stages_without_parameters(balance: Sequence[int], owners: Sequence[bool]) -> list[int]:
    """The stages of ``balance`` whose layers hold no parameter."""
    return [s for s, (a, b) in enumerate(stage_bounds(balance)) if not any(owners[a:b])]


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate an explicit balance (layers per stage) and return it as a list."""
    balance = list(balance)
    if len(balance) != num_stages:
        raise ValueError(
            f"balance={balance} has {len(balance)} entries but the pipeline has {num_stages} stages "
            f"(one per device); give one layer count per stage, or use 'uniform' or 'parameters'."
        )
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in balance):
        raise ValueError(f"balance={balance} must hold positive integers: every stage needs at least one layer.")
    if sum(balance) != num_layers:
        raise ValueError(
            f"balance={balance} sums to {sum(balance)} but the module has {num_layers} layers; "
            f"the layer counts must add up to {num_layers}."
        )
    return balance


def _check_counts(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"the pipeline needs at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: every stage needs at least one layer. "
            f"Use at most {num_layers} devices, or split the model into more layers."
        )


def balance_uniform(num_layers: int, num_stages: int, owners: Owners = None) -> list[int]:
    """Equal layer counts; the first ``num_layers % num_stages`` stages take one more layer, so the
    last stage, which also computes the loss, is never the largest. With ``owners``, where equal
    counts would leave a stage without a parameter, the most even split that gives every stage one."""
    _check_counts(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    even = [base + (1 if s < extra else 0) for s in range(num_stages)]
    owners = owning(owners, num_stages)
    if owners is None or not stages_without_parameters(even, owners):
        return even
    return balance_by_cost([1.0] * num_layers, num_stages, owners)


def balance_by_cost(costs: Sequence[float], num_stages: int, owners: Owners = None) -> list[int]:
    """Contiguous split minimising the most expensive stage, exactly (dynamic programming).

    Among the splits with that bottleneck it takes the most even one (least sum of squared stage
    costs), and then the one with the shorter later stages, so equal costs give the same answer as
    :func:`balance_uniform`. With ``owners``, only splits whose every stage holds a parameter count
    (where the layers allow it, :func:`owning`).
    """
    n = len(costs)
    _check_counts(n, num_stages)
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be non-negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    return balance_by_stage_cost(n, num_stages, lambda stage, j, i: prefix[i] - prefix[j], owners)


def balance_by_stage_cost(num_layers: int, num_stages: int, stage_cost: StageCost, owners: Owners = None) -> list[int]:
    """Contiguous split minimising the most expensive stage, exactly, where a stage's cost may
    depend on its position as well as its layers (the activation memory of a 1F1B stage grows with
    the micro-batches it holds, more on early stages). Ties are broken as in :func:`balance_by_cost`."""
    _check_counts(num_layers, num_stages)
    owners = owning(owners, num_stages)
    if owners is not None:  # a stage without a parameter costs infinitely much
        held = [0]
        for o in owners:
            held.append(held[-1] + bool(o))
        plain = stage_cost
        stage_cost = lambda s, j, i: plain(s, j, i) if held[i] > held[j] else float("inf")  # noqa: E731
    bottleneck = _solve(num_layers, num_stages, lambda acc, c: max(acc, c), stage_cost, limit=float("inf"))[0]
    tolerance = 1e-9 * max(1.0, bottleneck)
    _, balance = _solve(num_layers, num_stages, lambda acc, c: acc + c * c, stage_cost, limit=bottleneck + tolerance)
    return balance


def _solve(n: int, stages: int, combine, stage_cost: StageCost, limit: float) -> tuple[float, list[int]]:
    """Minimise ``combine`` over contiguous splits whose stages each cost at most ``limit`` (and less
    than infinity)."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(i - 1, k - 2, -1):  # the last stage holds layers j..i-1; shorter first
                c = stage_cost(k - 1, j, i)
                if c > limit or c == inf or best[k - 1][j] == inf:
                    continue
                value = combine(best[k - 1][j], c)
                if value < best[k][i] - 1e-12 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    balance: list[int] = []
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return best[stages][n], balance[::-1]


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` layer indices of each stage."""
    bounds, start = [], 0
    for count in balance:
        bounds.append((start, start + count))
        start += count
    return bounds
