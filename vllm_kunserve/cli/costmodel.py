"""``kunserve costmodel fit|eval``: fit the batch cost model (KunServe Eq. 1-3) and check it.

PROFILE is our JSON/JSONL profile (per batch the (prefix, chunk) pairs and the measured ms; see
docs/policy.md) or a Vidur ``mlp.csv`` (per-layer linear timings; fits beta and gamma only).

Two forms are fitted side by side: ``paper`` (Eq. 1-3, delta = 0) and ``extended`` (plus
``delta`` x the context read by each one-token decode chunk). ``--form`` picks the one written to
--out (default paper); both forms' coefficients and errors are printed and kept in the model's
``meta.forms``, so ``eval`` reports both on new rows too.
"""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("costmodel", help="fit and evaluate the batch cost model", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    f = s.add_parser("fit", help="fit alpha/beta/gamma (and delta) by non-negative least squares")
    f.add_argument("profile", help="profile file (.json, .jsonl, or Vidur mlp.csv)")
    f.add_argument("--out", required=True, help="where to write the model JSON")
    f.add_argument("--holdout", type=float, default=0.2, help="share of rows held out for the error report")
    f.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    f.add_argument("--tp", type=int, default=None, help="tensor-parallel degree to read from a Vidur csv")
    f.add_argument("--weighting", choices=("relative", "absolute"), default="relative",
                   help="least squares on relative (default) or absolute error")
    f.add_argument("--form", choices=("paper", "extended"), default="paper",
                   help="model written to --out: paper Eq. 1-3 (default) or with the decode KV-read term")
    f.set_defaults(func=run)
    e = s.add_parser("eval", help="mean/max relative error of a model (and of each form fitted with it) "
                                  "and of a token-count-only model")
    e.add_argument("model", help="model JSON written by `kunserve costmodel fit`")
    e.add_argument("profile", help="profile file (.json, .jsonl, or Vidur mlp.csv)")
    e.add_argument("--tp", type=int, default=None, help="tensor-parallel degree to read from a Vidur csv")
    e.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vllm_kunserve.policy.costmodel import CostModel, evaluate, fit_with_holdout, load_profile

    prof = load_profile(args.profile, args.tp)
    if args.action == "fit":
        if not 0 < args.holdout < 1:
            raise ValueError(f"--holdout={args.holdout}: must be in (0, 1)")
        model, report = fit_with_holdout(prof, args.holdout, args.seed, args.weighting, args.form)
        model.save(args.out)
        print(json.dumps({"model": model.to_dict(), "out": args.out, **report}, indent=2))
        return 0
    model = CostModel.load(args.model)
    print(json.dumps(evaluate(model, prof), indent=2))
    return 0
