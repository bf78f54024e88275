"""Time every experiment's default run, one at a time, into docs/data/timings.json.

    python scripts/time_defaults.py [--only saatp,esa] [--main-job]

Run it on a fresh clone with nothing else on the machine (`bash
scripts/bootstrap.sh` first); `--main-job` also times the README's main job
(`gradfabric reproduce --quick`). Each command's output goes to
`results/timings/`; `scripts/figures.py` then writes the times into the docs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "data" / "timings.json"
GF = [str(Path(sys.executable).parent / "gradfabric")]
EXPERIMENTS = ("saatp", "esa", "dlcp", "saatp-udp", "saatp-train", "esa-train", "dlcp-udp",
               "dlcp-train")  # fmt: skip


def timed(args: list[str], log: Path) -> float:
    start = time.monotonic()
    with log.open("w") as f:
        subprocess.run([*GF, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.monotonic() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated experiments (default: every one; '': none)")
    p.add_argument("--main-job", action="store_true", help="also `gradfabric reproduce --quick`")
    args = p.parse_args()
    logs = ROOT / "results" / "timings"
    logs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True, check=True).stdout.strip()  # fmt: skip
    data = json.loads(OUT.read_text()) if OUT.exists() else {"experiments": []}
    when = {"date": datetime.date.today().isoformat(), "commit": commit}
    runs = {r["command"]: r for r in data["experiments"]}
    names = args.only.split(",") if args.only is not None else EXPERIMENTS
    for name in [n for n in names if n]:  # (--only "" --main-job: the main job alone)
        seconds = timed(["experiment", name, "--json"], logs / f"{name}.log")
        command = f"gradfabric experiment {name}"
        runs[command] = {"command": command, "seconds": round(seconds, 1)} | when
        print(f"experiment {name}: {seconds:.0f} s", flush=True)
    data["experiments"] = list(runs.values())
    if args.main_job:
        seconds = timed(["reproduce", "--quick", "--json"], logs / "reproduce.log")
        data["main_job"] = {"seconds": round(seconds, 1)} | when
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
