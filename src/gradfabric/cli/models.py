"""``gradfabric models``: the model catalog."""

from __future__ import annotations

import argparse
import json

from gradfabric.cli.common import Sub, out, table


def add(sub: Sub) -> None:
    m = sub.add_parser("models", help="list the model catalog")
    m.add_argument("--json", action="store_true", help="the catalog as one JSON list")
    m.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from gradfabric.workloads.catalog import MODEL_NAMES, model_spec

    rows = [
        {
            "model": m,
            "params": model_spec(m).params,
            "layers": len(model_spec(m).layers),
            "fwd_gflops_per_sample": model_spec(m).fwd_flops / 1e9,
        }
        for m in MODEL_NAMES
    ]
    if args.json:
        print(json.dumps(rows))
    else:
        out.print(
            table(rows, "model catalog", ["model", "params", "layers", "fwd_gflops_per_sample"])
        )
    return 0
