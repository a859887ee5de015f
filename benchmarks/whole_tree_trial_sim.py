"""How close the budget's whole-tree trial (:mod:`specdraft.budget.whole_tree`) comes to the faster
of its two arms, on simulated steps.

Each step draws the tokens it commits and the seconds it takes from the arm that runs it: one
token plus, with some probability, a geometric run of drafted ones, and a time within 10% of the
arm's mean. The default cases are shaped like the GPU emulation's MT-Bench steps
(``benchmarks/results/gpu-emulation-*``): whole trees 1.55 tokens in 5.92 ms, the budget's
choice 1.26 in 5.56 ms. The simulation has no sources, so it cannot show what whole trees teach
Token Recycling; it shows only how the trial's averages and schedule cope with noisy steps.

    python benchmarks/whole_tree_trial_sim.py [--steps 700] [--runs 100] [--smoothing 0.05]
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft.budget.whole_tree import CHOICE, WHOLE, WholeTreeTrial  # noqa: E402

#: case -> per arm: (mean drafted tokens per step, probability of none, mean ms per step)
CASES = {
    "whole trees 15% faster": {WHOLE: (0.55, 0.60, 5.92), CHOICE: (0.26, 0.75, 5.56)},
    "the choice 25% faster": {WHOLE: (0.30, 0.70, 6.20), CHOICE: (0.26, 0.75, 4.80)},
    "whole trees cost twice the choice": {WHOLE: (0.55, 0.60, 11.80), CHOICE: (0.26, 0.75, 5.56)},
}


def draw_tokens(rng: random.Random, drafted: float, none: float) -> int:
    """One step's committed tokens: 1, plus a geometric run with mean ``drafted / (1 - none)``
    with probability ``1 - none``."""
    if rng.random() < none:
        return 1
    mean = drafted / (1 - none)
    run = 1
    while rng.random() < 1 - 1 / mean:
        run += 1
    return 1 + run


def speed(arm: tuple[float, float, float]) -> float:
    return (1 + arm[0]) / arm[2] * 1e3


def simulate(case: dict[int, tuple[float, float, float]], steps: int, seed: int, **options) -> float:
    """Tokens per second of one run of ``steps`` steps with the trial picking the arms."""
    rng = random.Random(seed)
    trial = WholeTreeTrial(**options)
    tokens = seconds = 0.0
    for _ in range(steps):
        drafted, none, ms = case[trial.pick()]
        step_tokens, step_seconds = draw_tokens(rng, drafted, none), ms * rng.uniform(0.9, 1.1) / 1e3
        trial.observe(step_tokens, step_seconds)
        tokens += step_tokens
        seconds += step_seconds
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--smoothing", type=float, default=None)
    args = parser.parse_args()
    options = {} if args.smoothing is None else {"smoothing": args.smoothing}
    for name, case in CASES.items():
        best = max(speed(case[WHOLE]), speed(case[CHOICE]))
        mean = statistics.mean(simulate(case, args.steps, seed, **options) for seed in range(args.runs))
        print(f"{name}: the trial at {mean / best:.2f} of the faster arm ({mean:.0f} against {best:.0f} tokens/s)")


if __name__ == "__main__":
    main()
