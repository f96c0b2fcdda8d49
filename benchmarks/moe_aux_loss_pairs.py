"""The step time of the MoE load-balancing loss on against off, in alternating pairs of whole runs of
``moe_aux_loss.py`` (which of the two runs first alternates), so that the machine's drift falls on both:

    python benchmarks/moe_aux_loss_pairs.py 8 --steps 24 --warmup 4

Prints each run's median step on rank 0, the ratio on/off per pair, and their median and range.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(aux: str, extra: list[str]) -> tuple[float, float]:
    """One whole run: rank 0's median step (s) and the run's wall-clock seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
    start = time.time()
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "moe_aux_loss.py"), "--aux", aux, *extra],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    line = [text for text in out.stdout.splitlines() if text.startswith("{")][-1]
    return json.loads(line)["median_step_s"], time.time() - start


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    extra = sys.argv[2:]
    run("on", extra), run("off", extra)  # a warm-up pair
    ratios, walls = [], []
    for i in range(pairs):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        result = {aux: run(aux, extra) for aux in order}
        ratios.append(result["on"][0] / result["off"][0])
        walls.append(result["on"][1] / result["off"][1])
        print(
            f"pair {i + 1} ({order[0]} first): on {result['on'][0]:.4f} s, off {result['off'][0]:.4f} s, "
            f"ratio {ratios[-1]:.3f}, wall ratio {walls[-1]:.3f}, load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    print(
        f"step time on/off: median {statistics.median(ratios):.3f} ({min(ratios):.3f} to {max(ratios):.3f}) over "
        f"{pairs} pairs; whole-run wall ratio median {statistics.median(walls):.3f}"
    )


if __name__ == "__main__":
    main()
