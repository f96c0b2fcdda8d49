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
        f"Measured {machine['date']} on {machine['cpus']} CPU cores ({machine['processor']}), torch {machine['torch']}, "
        f"lightning {machine['lightning']}; the whole command took {machine['wall_s']:.0f} s.\n"
    )
    for model, entry in results.items():
        if model.startswith("_"):
            continue
        out.append(f"### {model}: batch {entry['batch']}, {entry['chunks']} micro-batches, {entry['stages']} stages\n")
        out.append("| contender | median s/step | samples/s | lightning-pipe 1F1B speed-up |")
        out.append("|---|---:|---:|---:|")
        speedups = entry.get("pipe_1f1b_speedup_over", {})
        for name, r in entry["contenders"].items():
            ratio = speedups.get(name)
            out.append(
                f"| {name} | {r['median_step_s']:.4f} | {r['samples_per_s']:.1f} | {'' if ratio is None else f'{ratio:.2f}x'} |"
            )
        if "ideal_step_s" in entry:
            out.append(
                f"\nIdeal pipeline ({entry['stages']} stages): plain_micro x (m+p-1)/(p m) = {entry['ideal_step_s']:.4f} s/step; "
                f"lightning-pipe 1F1B takes {entry['pipe_1f1b_over_ideal']:.2f}x the ideal.\n"
            )
        memory = entry.get("activation_memory")
        if memory:
            out.append("Peak bytes of activations saved for the backward, per stage:\n")
            out.append("| schedule / checkpoint | stage 0 | stage 1 |")
            out.append("|---|---:|---:|")
            for key, peaks in memory["peak_bytes"].items():
                out.append(f"| {key} | {peaks[0]:,} | {peaks[1]:,} |")
            out.append(
                f"\nMicro-batches held (peak / one micro-batch's activations), measured vs closed form: "
                f"GPipe {memory['microbatches_held']['gpipe/never']} vs {memory['closed_form_microbatches']['gpipe/never']}, "
                f"1F1B {memory['microbatches_held']['1f1b/never']} vs {memory['closed_form_microbatches']['1f1b/never']}. "
                f"1F1B / GPipe on stage 0: {memory['ratio_1f1b_to_gpipe_stage0']:.3f} (bound p/m = {memory['bound_p_over_m']:.3f}). "
                f"With checkpoint='always' the bytes beyond the held micro-batches' stage inputs "
                f"({memory['stage_input_bytes_per_microbatch']} bytes each) are "
                f"{memory['always_bytes_beyond_stage_inputs']}.\n"
            )
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/results.json") as f:
        print(tables(json.load(f)))
