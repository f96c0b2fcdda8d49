"""Where a pipeline step's time goes, against what the schedule would take if the pipeline cost
nothing itself: the simulated bubble and the ideal step.

    python benchmarks/overhead.py                                   # 1f1b and zero_bubble, 7 rounds
    python benchmarks/overhead.py --rounds 9 --against /tmp/before  # paired: this tree against another checkout

The workload is the benchmark MLP (8 blocks of width 1024 and a head, batch 256 in 8 micro-batches,
``balance="parameters"``, or ``--balance``) on 2 CPU processes with one thread each; ``1stage`` is
lightning-pipe on one process with the same micro-batches. Every run is a fresh interpreter. Per run:

- on every rank, the parts of each step (:class:`lightning_pipe.observe.StepProfile`: compute,
  waiting on a peer, posting communication, the executor's own Python, the work before and after
  the executor, the gradients' hand-over, the optimizer, Lightning's loop between steps);
- the measured bubble per rank (the share of the executor's run that is not F, B or W), and the
  bubble of the same schedule simulated with the run's median F, B and W times per stage, per rank
  and as the mean over ranks: the ratios set each rank against its own simulated share, and the
  mean against the mean; and played again with each rank's measured posting time spread over its
  F and B (compute alone counted as busy), to show how much of the gap posting explains;
- the step time on rank 0 (from one batch's end to the next);
- what the uneven split costs: the schedule simulated at the measured costs against the same total
  cost evened out over the stages, and the ideal / step ratio with that difference taken off the step.

Rounds alternate the order of the runs. The ideal step is the 1stage median x (m + p - 1) / (p m);
each schedule's ratio ideal / step is taken per round (paired) and its median reported.

With ``--against DIR`` every run also runs with the library imported from ``DIR`` (another
checkout), alternating A B / B A, and the paired ratio before / after per round is reported: how
a change moved the step. Writes ``--out``/overhead.json and prints the Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COMPUTE = ("F", "B", "W")


def child(config: dict[str, Any]) -> None:
    """One run, in this interpreter: the library comes first on ``sys.path`` from ``config['root']``."""
    sys.path.insert(0, config["root"])
    sys.path.insert(1, HERE)
    import importlib.util

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_pipe
    from lightning_pipe import PipelineStrategy  # first: step_time puts this tree on sys.path too

    if not os.path.abspath(lightning_pipe.__file__).startswith(os.path.abspath(config["root"]) + os.sep):
        raise RuntimeError(f"lightning_pipe came from {lightning_pipe.__file__}, not from {config['root']}")
    from step_time import MLP

    # the profiler of this tree, whatever the library's checkout (it only reads the timeline)
    spec = importlib.util.spec_from_file_location(
        "_step_profile", os.path.join(ROOT, "lightning_pipe", "plan", "step_profile.py")
    )
    profile_module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(profile_module)  # type: ignore[union-attr]
    folder = config["folder"]

    class Spans(L.Callback):
        def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
            self.timeline = trainer.strategy.pipeline.enable_timeline()

        def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
            steps = [[(s.name, s.stage, s.seconds) for s in spans] for spans in self.timeline.steps]
            with open(os.path.join(folder, f"spans{trainer.global_rank}.json"), "w") as f:
                json.dump(steps, f)

    class Profiled(L.Callback):
        """``--cprofile``: each rank's training under cProfile, the stats to ``cprofile{rank}``."""

        def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()

        def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
            self.profiler.disable()
            self.profiler.dump_stats(os.path.join(config["cprofile"], f"cprofile{trainer.global_rank}"))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(config["width"], config["blocks"], heavy=config.get("heavy", 1))
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(config["batch"] * 4, config["width"], generator=g),
        torch.randint(0, 10, (config["batch"] * 4,), generator=g),
    )
    data = DataLoader(TensorDataset(x, y), batch_size=config["batch"])
    stages = 1 if config["schedule"] == "1stage" else config["stages"]
    strategy = PipelineStrategy(
        schedule="1f1b" if stages == 1 else config["schedule"],
        chunks=config["chunks"],
        balance=config.get("balance", "parameters"),
        start_method="fork",
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=stages, max_steps=config["steps"], max_epochs=-1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, strategy=strategy,
        callbacks=[profile_module.StepProfile(folder), Spans(), *([Profiled()] if config.get("cprofile") else [])],
    )  # fmt: skip
    trainer.fit(model, data)


def run(root: str, schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        config = {"root": root, "folder": folder, "schedule": schedule, "stages": args.stages, "chunks": args.chunks,
                  "width": args.width, "blocks": args.blocks, "batch": args.batch, "steps": args.steps,
                  "cprofile": args.cprofile, "balance": args.balance, "heavy": args.heavy}  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
        done = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(config)], env=env, cwd=root, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"{schedule} ({root}) failed:\n{done.stderr[-4000:]}")
        ranks = 1 if schedule == "1stage" else args.stages
        rows = [json.loads(Path(folder, f"step_profile_rank{r}.json").read_text()) for r in range(ranks)]
        spans = [json.loads(Path(folder, f"spans{r}.json").read_text()) for r in range(ranks)]
    return analyse(schedule, rows, spans, args)


def analyse(
    schedule: str, rows: list[list[dict[str, float]]], spans: list[list[Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """Step time, the parts per rank, the measured and the simulated bubble of one run."""
    sys.path.insert(0, ROOT)
    from lightning_pipe.observe.step_profile import means
    from lightning_pipe.schedules import build, simulate

    warm = args.warmup
    parts = [means(r, skip=warm) for r in rows]
    step_s = statistics.median(row["total"] for row in rows[0][warm:] if "total" in row)
    result: dict[str, Any] = {"step_s": step_s, "parts": parts}
    if schedule == "1stage":
        return result
    per_stage: dict[int, dict[str, list[float]]] = {}
    bubbles = []
    for rank_steps in spans:
        shares = []
        for step in rank_steps[warm:]:
            total = next(sec for name, _, sec in step if name == "step")
            busy = sum(sec for name, _, sec in step if name in COMPUTE)
            shares.append(1.0 - busy / total)
            for name, stage, sec in step:
                if name in COMPUTE:
                    per_stage.setdefault(stage, {}).setdefault(name, []).append(sec)
        bubbles.append(statistics.median(shares))
    costs = [tuple(statistics.median(per_stage[s].get(k, [0.0])) for k in COMPUTE) for s in sorted(per_stage)]
    plan = build(schedule, args.stages, args.chunks, len(costs) // args.stages)
    played = simulate(plan, stage_costs=costs, rendezvous=False)
    result["measured_bubble"] = bubbles
    result["simulated_bubble"] = played.bubble_fraction  # the mean over ranks
    # each rank's own idle share, to set against the same rank's measured bubble
    result["simulated_bubble_per_rank"] = [1.0 - busy / played.makespan for busy in played.busy]
    # the same schedule with each rank's measured posting time spread over its F and B (the rank
    # posts in its own thread, between its computations): how much of the gap posting explains
    posting = [
        statistics.median(sum(sec for name, _, sec in step if name == "post") for step in rank_steps[warm:])
        for rank_steps in spans
    ]
    with_posting = list(costs)
    for rank, posted in enumerate(posting):
        stages = [s for s in range(len(costs)) if plan.rank_of(s) == rank]
        share = posted / (2 * args.chunks * len(stages))
        for s in stages:
            with_posting[s] = (costs[s][0] + share, costs[s][1] + share, *costs[s][2:])
    replayed = simulate(plan, stage_costs=with_posting, rendezvous=False)
    result["simulated_bubble_with_posting_per_rank"] = [1.0 - busy / replayed.makespan for busy in played.busy]
    # the same schedule with the stages' costs evened out (each stage the mean of each kind): how
    # much longer the run of the schedule is because the split is uneven
    even = tuple(statistics.fmean(c[k] for c in costs) for k in range(len(COMPUTE)))
    result["simulated_makespan_s"] = played.makespan
    result["even_split_makespan_s"] = simulate(plan, stage_costs=[even] * len(costs), rendezvous=False).makespan
    result["stage_costs_ms"] = [[round(1e3 * c, 3) for c in stage] for stage in costs]
    return result


def parts_table(parts: list[dict[str, float]]) -> str:
    sys.path.insert(0, ROOT)
    from lightning_pipe.observe.step_profile import markdown

    return markdown(parts)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # before anything imports the library from this tree
        child(json.loads(sys.argv[2]))
        return
    sys.path.insert(0, HERE)
    from step_time import workload_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default="1f1b,zero_bubble")
    workload_arguments(parser, rounds=7, steps=16)
    parser.add_argument("--balance", default="parameters", help="the strategy's balance (parameters, time, ...)")
    parser.add_argument(
        "--heavy", type=int, default=1, help="the first half's blocks this many times as costly (MLP(heavy=))"
    )
    parser.add_argument(
        "--against", default=None, help="another checkout: each run also runs with its library (paired)"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="overhead", help="the results file's name, without .json")
    parser.add_argument(
        "--cprofile", default=None, help="a folder: each rank's training under cProfile (slower) to cprofile<rank>"
    )
    args = parser.parse_args()
    trees = {"after": ROOT} if args.against is None else {"before": os.path.abspath(args.against), "after": ROOT}
    runs = ["1stage", *args.schedules.split(",")]
    jobs = [(tree, schedule) for schedule in runs for tree in trees]
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        rounds.append({})
        for tree, schedule in jobs if index % 2 == 0 else jobs[::-1]:
            rounds[-1][f"{tree}:{schedule}"] = run(trees[tree], schedule, args)
        print(
            json.dumps({"round": index, **{k: round(v["step_s"] * 1e3, 2) for k, v in rounds[-1].items()}}), flush=True
        )
    m, p = args.chunks, args.stages
    summary: dict[str, Any] = {"config": vars(args), "runs": {}}
    for tree in trees:
        for schedule in runs:
            key = f"{tree}:{schedule}"
            entries = [r[key] for r in rounds]
            entry: dict[str, Any] = {
                "median_step_ms": round(1e3 * statistics.median(e["step_s"] for e in entries), 3),
                "parts_ms_per_rank": [
                    {
                        k: round(1e3 * statistics.median(e["parts"][r][k] for e in entries), 3)
                        for k in entries[0]["parts"][r]
                    }
                    for r in range(len(entries[0]["parts"]))
                ],
            }
            if schedule != "1stage":
                ideal = [r[f"{tree}:1stage"]["step_s"] * (m + p - 1) / (p * m) / r[key]["step_s"] for r in rounds]
                entry["ideal_over_step_per_round"] = [round(v, 3) for v in ideal]
                entry["ideal_over_step_median"] = round(statistics.median(ideal), 3)
                entry["measured_bubble_per_rank"] = [
                    round(statistics.median(e["measured_bubble"][r] for e in entries), 4) for r in range(p)
                ]
                entry["simulated_bubble"] = round(statistics.median(e["simulated_bubble"] for e in entries), 4)
                entry["simulated_bubble_per_rank"] = [
                    round(statistics.median(e["simulated_bubble_per_rank"][r] for e in entries), 4) for r in range(p)
                ]
                # like for like: each rank against its own simulated idle share, and the mean over
                # ranks against the mean
                entry["measured_over_simulated_per_rank"] = [
                    round(measured / simulated, 3) if simulated > 0 else None
                    for measured, simulated in zip(
                        entry["measured_bubble_per_rank"], entry["simulated_bubble_per_rank"]
                    )
                ]
                entry["measured_over_simulated_mean"] = round(
                    statistics.mean(entry["measured_bubble_per_rank"]) / entry["simulated_bubble"], 3
                )
                posted = [
                    round(statistics.median(e["simulated_bubble_with_posting_per_rank"][r] for e in entries), 4)
                    for r in range(p)
                ]
                entry["simulated_bubble_with_posting_per_rank"] = posted
                entry["measured_over_simulated_with_posting_mean"] = round(
                    statistics.mean(entry["measured_bubble_per_rank"]) / statistics.mean(posted), 3
                )
                # what the uneven split costs: the simulated run at the measured costs against the
                # same total evened over the stages, and the ideal against the step less that time
                entry["uneven_split_over_even_median"] = round(
                    statistics.median(e["simulated_makespan_s"] / e["even_split_makespan_s"] for e in entries), 4
                )
                even_ideal = [
                    r[f"{tree}:1stage"]["step_s"]
                    * (m + p - 1)
                    / (p * m)
                    / (r[key]["step_s"] - r[key]["simulated_makespan_s"] + r[key]["even_split_makespan_s"])
                    for r in rounds
                ]
                entry["ideal_over_step_even_split_median"] = round(statistics.median(even_ideal), 3)
            if "before" in trees:
                ratios = [r[f"before:{schedule}"]["step_s"] / r[f"after:{schedule}"]["step_s"] for r in rounds]
                entry["before_over_after_per_round"] = [round(v, 3) for v in ratios]
                entry["before_over_after_median"] = round(statistics.median(ratios), 3)
            summary["runs"][key] = entry
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for key, entry in summary["runs"].items():
        print(f"\n## {key}: median step {entry['median_step_ms']} ms over {args.rounds} rounds")
        print(json.dumps({k: v for k, v in entry.items() if k not in ("parts_ms_per_rank",)}))
        print(parts_table([{k: v / 1e3 for k, v in part.items()} for part in entry["parts_ms_per_rank"]]))


if __name__ == "__main__":
    main()
