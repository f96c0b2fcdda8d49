"""Render ``benchmarks/results/results.json`` (from ``compare.py``) as the tables of ``docs/benchmarks.md``.

python benchmarks/report.py benchmarks/results/results.json > docs/benchmarks-tables.md
"""

from __future__ import annotations

import json
import sys


def tables(results: dict) -> str:
    out = []
    machine = results["_machine"]
    out.append(
        f"Measured {machine['date']} on {machine['cpus']} CPU cores ({machine['processor']}), device "
        f"{machine.get('device', 'cpu')}, torch {machine['torch']}, "
        f"lightning {machine['lightning']}; the whole command took {machine['wall_s']:.0f} s.\n"
    )
    for model, entry in results.items():
        if model.startswith("_"):
            continue
        out.append(f"### {model}: batch {entry['batch']}, {entry['chunks']} micro-batches, {entry['stages']} stages\n")
        out.append(
            "| contender | median s/step | samples/s | steps | lightning-pipe 1F1B speed-up | paired (median of "
            "rounds) |"
        )
        out.append("|---|---:|---:|---:|---:|---:|")
        speedups = entry.get("pipe_1f1b_speedup_over", {})
        paired = entry.get("pipe_1f1b_speedup_paired_median", {})
        for name, r in entry["contenders"].items():
            ratio, pair = speedups.get(name), paired.get(name)
            out.append(
                f"| {name} | {r['median_step_s']:.4f} | {r['samples_per_s']:.1f} | {r['steps']} | "
                f"{'' if ratio is None else f'{ratio:.2f}x'} | {'' if pair is None else f'{pair:.2f}x'} |"
            )
        rounds = entry.get("pipe_1f1b_speedup_per_round", {}).get("torch_1f1b")
        if rounds:
            out.append(
                f"\nlightning-pipe 1F1B speed-up over torch's Schedule1F1B in each of {len(rounds)} rounds: "
                + ", ".join(f"{r:.2f}" for r in rounds)
                + f" ({sum(r >= 1 for r in rounds)} of {len(rounds)} at least 1).\n"
            )
        unfused = entry.get("unfused_speedup_over_torch_1f1b_per_round")
        if unfused:
            out.append(
                "Without gradient-accumulation fusion (pipe_1f1b_unfused), lightning-pipe 1F1B's speed-up over torch's "
                f"Schedule1F1B in each of {len(unfused)} rounds: "
                + ", ".join(f"{r:.2f}" for r in unfused)
                + f" (median {entry['unfused_speedup_over_torch_1f1b_paired_median']:.2f}).\n"
            )
        if "pipe_1stage_over_plain" in entry:
            out.append(
                f"lightning-pipe on one process (pipe_1stage, {entry['chunks']} micro-batches in one step) takes "
                f"{entry['pipe_1stage_over_plain']:.2f}x plain Lightning's step time on whole batches and "
                f"{entry.get('pipe_1stage_over_plain_micro', float('nan')):.2f}x on the same micro-batches "
                "(a Lightning step per micro-batch, accumulate_grad_batches).\n"
            )
        if "ideal_step_s" in entry:
            out.append(
                f"\nIdeal pipeline ({entry['stages']} stages): the faster of plain_micro and pipe_1stage x (m+p-1)/(p "
                f"m) = {entry['ideal_step_s']:.4f} s/step; lightning-pipe 1F1B takes "
                f"{entry['pipe_1f1b_over_ideal']:.2f}x the ideal.\n"
            )
        for contender, ranks in entry.get("breakdown", {}).items():
            out.append(f"Where {contender}'s step goes, mean ms per step on each rank:\n")
            columns = ["F", "B", "post", "wait", "step", "outside_executor", "step_interval"]
            out.append(
                "| rank | "
                + " | ".join(columns)
                + (" | peak allocated |" if "peak_allocated_bytes" in ranks[0] else " |")
            )
            out.append("|---:|" + "---:|" * (len(columns) + ("peak_allocated_bytes" in ranks[0])))
            for rank, row in enumerate(ranks):
                cells = " | ".join(f"{1000 * row.get(c, 0.0):.1f}" for c in columns)
                peak = f" {row['peak_allocated_bytes']:,} |" if "peak_allocated_bytes" in row else ""
                out.append(f"| {rank} | {cells} |{peak}")
            out.append("")
        memory = entry.get("activation_memory")
        if memory:
            out.append("Peak bytes of activations saved for the backward, per stage:\n")
            out.append("| schedule / recompute | stage 0 | stage 1 |")
            out.append("|---|---:|---:|")
            for key, peaks in memory["peak_bytes"].items():
                out.append(f"| {key} | {peaks[0]:,} | {peaks[1]:,} |")
            out.append(
                "\nMicro-batches held (peak / one micro-batch's activations), measured vs closed form: GPipe "
                f"{memory['microbatches_held']['gpipe/never']} vs {memory['closed_form_microbatches']['gpipe/never']}, "
                f"1F1B {memory['microbatches_held']['1f1b/never']} vs "
                f"{memory['closed_form_microbatches']['1f1b/never']}. 1F1B / GPipe on stage 0: "
                f"{memory['ratio_1f1b_to_gpipe_stage0']:.3f} (bound p/m = {memory['bound_p_over_m']:.3f}). With "
                "recompute='always' the bytes beyond the held micro-batches' stage inputs "
                f"({memory['stage_input_bytes_per_microbatch']} bytes each) are "
                f"{memory['always_bytes_beyond_stage_inputs']}.\n"
            )
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/results.json") as f:
        print(tables(json.load(f)))
