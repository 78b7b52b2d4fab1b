"""Does `make demo` show the effect every time? The demo's comparison run several times in a row on
this machine, and the spread of each system's ratios to stock, recorded per machine kind.

    python -m benchmarks.demo_spread [--runs 3]

Each run is exactly `make demo`'s (``vllm_kunserve/cli/demo.py``: the same model, memory, burst
rule and seed; the users' closed loop sets the load, so nothing is sized from the machine's speed). Writes
``docs/benchmarks/demo_spread.{md,json,png}``: the runs of this machine kind replace that kind's
earlier ones, other kinds' runs are kept from the JSON. Raw data: one archive per run,
``docs/benchmarks/runs/demo_spread_<kind>_<k>.tar.xz``. The verdict rule, fixed before the runs:
a kind passes when every one of its runs meets the demo's targets (kunserve's P99 TTFT at most 0.3x
stock's, its P50 TPOT at most 1.2x).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import raw
from benchmarks.common.stats import median_range
from vllm_kunserve.cli.demo import TARGETS, run_demo
from vllm_kunserve.bench.report import REPO, command, md_table, pyplot, save_figure, write_json

PAGE = REPO / "docs" / "benchmarks" / "demo_spread"
KEYS = (("ttft_p99", "TTFT P99"), ("tpot_p50", "TPOT P50"), ("e2e_p99", "E2E P99"))


def kind_slug(m: dict) -> str:
    return re.sub(r"[^a-z0-9]+", "_", f"{m['cpu']} {m['kind']}".lower()).strip("_")


def spread(xs: list[float]) -> str:
    m = median_range(xs)
    return f"{m['median']:.2f}x ({m['min']:.2f}-{m['max']:.2f}x)"


def row(k: int, d: dict) -> list:
    r = d["ratios"]
    g = d["facts"]["kunserve"].get("grouped_s")
    cells = [k, f"{d['wall_s']:.0f}", f"{g[0]:.0f}-{g[1]:.0f}" if g else "never"]
    for s in ("kunserve", "oracle-equal"):
        cells += [f"{r[s][key]:.2f}x" if r[s][key] is not None else "-" for key, _ in KEYS]
    cells.append("yes" if all(d["met"].values()) else "no")
    return cells


def render(runs: dict[str, list[dict]], cmd: str) -> list[str]:
    L = ["# Does `make demo` show the effect every time? (written by benchmarks/demo_spread.py)", "",
         f"Command: `{cmd}`. Each run is `make demo`'s comparison (vllm_kunserve/cli/demo.py: stock vLLM, "
         "kunserve's cluster drop and oracle-equal on 2 engines each, one burst where KV binds and compute does "
         "not); ratios are each system's value / stock's in the same run. Rule fixed before the runs: a machine "
         f"kind passes when every run meets the demo's targets (kunserve's P99 TTFT <= {TARGETS['ttft_p99']}x "
         f"stock's, P50 TPOT <= {TARGETS['tpot_p50']}x). Raw data: `docs/benchmarks/runs/demo_spread_*.tar.xz`.", ""]
    for kind, rs in sorted(runs.items()):
        m = rs[0]["machine"]
        ok = sum(all(d["met"].values()) for d in rs)
        L += [f"## {m['cpu']} ({m['kind']}), {m['cores']} cores", "",
              f"**{'Passes' if ok == len(rs) else 'Fails'}: {ok} of {len(rs)} runs meet both targets.** "
              + "; ".join(f"kunserve {label} {spread([d['ratios']['kunserve'][key] for d in rs])}"
                          for key, label in KEYS) + " (median, range).", ""]
        L += md_table(["run", "wall (s)", "kunserve grouped (s)"]
                      + [f"{s} {label}" for s in ("kunserve", "oracle-equal") for _, label in KEYS] + ["targets met"],
                      "rrr" + "r" * 6 + "l", (row(k + 1, d) for k, d in enumerate(rs)))
        L.append("")
        first = rs[0]
        L += ["Stock's absolute figures: " + "; ".join(
            f"run {k + 1} TTFT P99 {d['absolute']['vllm']['ttft_p99']:.2f} s, TPOT P50 "
            f"{1e3 * d['absolute']['vllm']['tpot_p50']:.0f} ms, E2E P99 {d['absolute']['vllm']['e2e_p99']:.1f} s"
            for k, d in enumerate(rs)) + f". The burst: {rs[0]['burst']['requests']} requests from a closed loop of "
              f"users, {rs[0]['burst']['schedule']} (users from each second on), prompt {rs[0]['burst']['prompt']}, "
              f"outputs {rs[0]['burst']['outputs'][0]}-{rs[0]['burst']['outputs'][1]} tokens; weight share "
              f"{rs[0]['weight_share']}; kunserve's config `{json.dumps(rs[0].get('kunserve_config'))}` (the "
              "demo's at the time: a kind's runs are replaced when it runs again).", ""]
    L += ["![ratios per run](demo_spread.png)", ""]
    return L


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(KEYS), figsize=(11, 3.6), sharey=False)
    for ax, (key, label) in zip(axes, KEYS):
        for i, (kind, rs) in enumerate(sorted(runs.items())):
            for j, s in enumerate(("kunserve", "oracle-equal")):
                ys = [d["ratios"][s][key] for d in rs if d["ratios"][s][key] is not None]
                ax.scatter([i + 0.15 * (2 * j - 1)] * len(ys), ys, label=s if i == 0 else None,
                           color=("tab:orange", "tab:green")[j])
        if key in TARGETS:
            ax.axhline(TARGETS[key], color="grey", ls="--", lw=0.8)
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xticks(range(len(runs)), [k.replace("_", " ")[:24] for k in sorted(runs)], fontsize=7)
        ax.set_title(f"{label} / stock's")
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def pack(run: Path, name: str, page: dict) -> Path:
    """The run's raw data, its pictures left out (the page's picture and the run's are drawn from it)."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(run, Path(tmp) / name, ignore=shutil.ignore_patterns("*.png"))
        return raw.pack(Path(tmp) / name, name, page=page)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "runs" / "demo_spread"))
    ap.add_argument("--render", action="store_true", help="run nothing: rewrite the page and picture from its JSON")
    a = ap.parse_args()
    if a.render:
        page = json.loads(PAGE.with_suffix(".json").read_text())
        plot(page["runs"], PAGE.with_suffix(".png"))
        PAGE.with_suffix(".md").write_text("\n".join(render(page["runs"], page["command"])))
        return 0
    if a.runs < 1:
        ap.error("--runs must be >= 1")
    out = Path(a.out)
    model = REPO / "models" / "demo-48x256"
    done = []
    for k in range(a.runs):
        d_out = out / f"run{k + 1}"
        shutil.rmtree(d_out, ignore_errors=True)
        print(f"== demo run {k + 1} of {a.runs}", flush=True)
        done.append((d_out, run_demo(model, d_out)))
    kind = kind_slug(done[0][1]["machine"])
    old = json.loads(PAGE.with_suffix(".json").read_text()) if PAGE.with_suffix(".json").exists() else {}
    runs = {k: v for k, v in old.get("runs", {}).items() if k != kind}
    runs[kind] = [d for _, d in done]
    for p in raw.ARCHIVES.glob(f"demo_spread_{kind}_*{raw.SUFFIX}"):
        p.unlink()
    for k, (d_out, d) in enumerate(done):
        pack(d_out, f"demo_spread_{kind}_{k + 1}", d)
    cmd = command("demo_spread.py", sys.argv[1:])
    write_json(PAGE.with_suffix(".json"), {"command": cmd, "targets": TARGETS, "runs": runs}, indent=1)
    plot(runs, PAGE.with_suffix(".png"))
    PAGE.with_suffix(".md").write_text("\n".join(render(runs, cmd)))
    print(f"wrote {PAGE.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
