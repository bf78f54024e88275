"""Simulator speed of two revisions, side by side in one run.

    .venv/bin/python scripts/sim_speed_ab.py BASE [HEAD] [--rounds 5] [--scheme atp]

Checks both revisions out into temporary worktrees and alternates
``gradfabric bench sim --json --repeats 1 --paths python`` between them (A, B,
B, A, ...), so both see the same machine load; prints each side's median
events per second and the ratio HEAD/BASE. For refactors that must not slow
the simulator. The pure-Python engines: a worktree has no compiled modules
(``scripts/compile.py`` builds them in place, minutes per tree).
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


def bench(tree: Path, scheme: str, workers: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, "-m", "gradfabric.cli", "bench", "sim", "--json", "--repeats", "1",
           "--scheme", scheme, "--workers", str(workers), "--paths", "python"]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.splitlines()[-1])["events_per_s"]["python"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("head", nargs="?", default="HEAD")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scheme", default="atp")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for side, rev in (("base", args.base), ("head", args.head)):
            trees[side] = Path(tmp) / side
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[side]), rev],
                           check=True, capture_output=True)  # fmt: skip
        try:
            rates: dict[str, list[float]] = {"base": [], "head": []}
            for r in range(args.rounds):
                for side in ("base", "head") if r % 2 == 0 else ("head", "base"):
                    rates[side].append(bench(trees[side], args.scheme, args.workers))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=False)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({"base": args.base, "head": args.head, "rounds": args.rounds,
                      "events_per_s": rates, "median": med,
                      "ratio_head_over_base": med["head"] / med["base"]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
