"""`vitlab probe`: linear and k-NN probes of frozen features."""

from __future__ import annotations

import argparse

from vitlab.cli.fewshot import SOURCES, add_feature_options
from vitlab.validation import json_text


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe",
        help="linear (logistic regression) and k-NN probes of frozen features",
        description="Probe the frozen features of the whole training split, scored on the test "
        "split. linear: multinomial logistic regression (L-BFGS) on standardised features, C "
        "chosen on a held-out 10% of the training features from a log-spaced grid, then "
        "refitted on all. knn: cosine k-NN as DINO reports it, votes weighted by exp(sim / T). "
        + SOURCES,
    )
    add_feature_options(p)
    p.add_argument("--kind", choices=["linear", "knn", "both"], default="both",
                   help="which probes to fit (default both)")  # fmt: skip
    p.add_argument("--k", type=int, default=20, help="neighbours for k-NN (default 20)")
    p.add_argument("--temperature", type=float, default=0.07, help="k-NN vote temperature (0.07)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vitlab.eval.probe import format_probe, probe_checkpoint

    report = probe_checkpoint(
        args.checkpoint,
        data=args.data,
        data_dir=args.data_dir,
        kind=args.kind,
        features=args.features,
        k=args.k,
        temperature=args.temperature,
        batch_size=args.batch_size,
        device=args.device,
        cache_dir=args.cache_dir,
        progress=args.quiet <= args.verbose,
    )
    print(json_text(report) if args.json else format_probe(report))
    return 0
