"""The README's claim over every comparable run (benchmarks/common/headline.py) and the one-file run
archives it reads (benchmarks/common/raw.py)."""

import json
import math
from pathlib import Path

import pytest

from benchmarks.common import headline, raw

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def archives(tmp_path, monkeypatch):
    monkeypatch.setattr(raw, "ARCHIVES", tmp_path / "runs")
    monkeypatch.setattr(raw, "UNPACKED", tmp_path / "unpacked")
    return tmp_path


def _run(tmp: Path, name: str, serving: str, ttft: dict[str, float], reps: int = 2, n: int = 30) -> None:
    """A burst_value run folder with window requests of a fixed TTFT per system, archived."""
    folder = tmp / "src" / name
    for system, t in ttft.items():
        for k in range(1, reps + 1):
            d = folder / system / f"rep{k}"
            d.mkdir(parents=True)
            rows = ["idx,arrival_s,send_s,prompt_len,output_len,ok,error,ttft_s,tpot_s,e2e_s,output_tokens"]
            rows += [f"{i},{10 + i},{10 + i},64,100,1,,{t},0.1,{t + 10},100" for i in range(n)]
            rows += ["99,1.0,1.0,64,100,1,,0.2,0.05,5.2,100"]   # a warm-phase request
            (d / "requests.csv").write_text("\n".join(rows) + "\n")
    meta = {"cpu": "CPU", "preset": "p", "weight_share": 0.61, "mix": {"prompt_len": 64, "output_len": 100,
            "output_len_max": 100}, "load_note": "warm 0.5x and burst 2x the measured capacity", "window": [5.0, 60.0],
            "oracle_equal_x": 1.79, "scaling_rows": [{"batch": 1, "step_ms": 50.0}, {"batch": 32, "step_ms": 200.0}],
            "scaling_doc": "docs/benchmarks/batch_scaling_mha.md", "capacity": {"req_per_s": 0.5},
            "provenance": {"commit": "abc1234", "serving_code": serving}}
    raw.pack(folder, name, {"meta": meta})


def test_an_archive_holds_a_run_and_its_page_and_unpacks_to_the_same_files(archives):
    src = archives / "r"
    (src / "kunserve" / "rep1").mkdir(parents=True)
    (src / "kunserve" / "rep1" / "requests.csv").write_text("a,b\n1,2\n")
    import gzip
    (src / "kunserve" / "rep1" / "timeline.csv.gz").write_bytes(gzip.compress(b"second\n0\n"))
    a = raw.pack(src, "r", {"meta": {"x": 1}})
    first = a.read_bytes()
    assert raw.pack(src, "r", {"meta": {"x": 1}}).read_bytes() == first      # the same files, the same bytes
    out = raw.run_dir(a)
    assert (out / "kunserve" / "rep1" / "requests.csv").read_text() == "a,b\n1,2\n"
    assert (out / "kunserve" / "rep1" / "timeline.csv").read_text() == "second\n0\n"   # stored plain
    assert raw.page("r") == {"meta": {"x": 1}} and raw.names() == ["r"] and raw.run_dir("r") == out
    with pytest.raises(FileNotFoundError, match="neither a run folder nor an archived run"):
        raw.run_dir(archives / "nothing")


def test_every_comparable_run_is_pooled_and_another_serving_code_is_another_group(archives):
    _run(archives, "burst_value_a", "s1", {"kunserve": 2.0, "oracle-equal": 1.0})
    _run(archives, "burst_value_b", "s1", {"kunserve": 4.0, "oracle-equal": 1.0})
    _run(archives, "burst_value_c", "s1", {"kunserve": 3.0, "oracle-equal": 1.0, "vllm-router": 40.0})
    _run(archives, "burst_value_d", "s2", {"kunserve": 9.0, "oracle-equal": 1.0})
    groups = headline.collect()
    assert sorted(sorted(r.name for r in g) for g in groups.values()) == [
        ["burst_value_a", "burst_value_b", "burst_value_c"], ["burst_value_d"]]
    runs = next(g for g in groups.values() if len(g) == 3)
    s = headline.summarize(runs)
    k = s["systems"]["kunserve"]["ratio"]["ttft_p99"]
    assert (k["median"], k["min"], k["max"]) == pytest.approx((3.0, 2.0, 4.0))
    assert k["pooled"]["value"] == pytest.approx(4.0)   # the pooled P99 of 2, 3 and 4 s against 1 s
    assert s["systems"]["kunserve"]["runs"] == 3 and s["systems"]["vllm-router"]["runs"] == 1
    assert s["systems"]["kunserve"]["ratio"]["e2e_p50"]["median"] == pytest.approx(13.0 / 11.0)
    # goodput: TPOT <= 1.5x the step at the burst's batch; no timeline here: no batch, no bound
    assert s["bound"]["batch"] is None and "goodput" not in s["systems"]["kunserve"]
    line = "\n".join(headline.table(s))
    assert "3.00x (2.00..4.00); 4.00x" in line and "1 (reference)" in line


def test_the_goodput_bound_is_a_decode_step_at_the_bursts_batch():
    rows = [{"batch": 1, "step_ms": 60.0}, {"batch": 16, "step_ms": 100.0}, {"batch": 32, "step_ms": 180.0}]
    assert headline.step_ms_at(rows, 24) == pytest.approx(140.0)
    assert headline.step_ms_at(rows, 0.5) == 60.0 and headline.step_ms_at(rows, 48) == pytest.approx(260.0)


def test_the_readme_shows_what_the_script_computed():
    """README.md's block is the one ``burst_value.py --readme`` writes from its JSON: no hand-copied number."""
    d = json.loads((ROOT / "docs" / "benchmarks" / "burst_value_headline.json").read_text())
    heads = [(g["title"], None, g["summary"]) for g in d["groups"] if g["headline"]]
    assert heads and all(math.isfinite(h[2]["systems"]["kunserve"]["ratio"]["ttft_p99"]["median"]) for h in heads)
    block = headline.readme_block(heads, "docs/benchmarks/burst_value_headline.md",
                                  "docs/benchmarks/burst_value_headline.png")
    assert "\n".join(block) in (ROOT / "README.md").read_text()


def test_every_tracked_burst_run_was_measured_at_a_commit_of_this_repository():
    """The README's headline pools every archived ``burst_value`` run: a test's fixture or a run of
    another tree left in ``docs/benchmarks/runs`` would enter it (five such files once did)."""
    import subprocess
    git = ["git", "-C", str(ROOT)]
    if subprocess.run([*git, "rev-parse", "--is-shallow-repository"], capture_output=True,
                      text=True).stdout.strip() != "false":
        pytest.skip("needs the repository's full history")
    names = [n for n in raw.names() if n.startswith("burst_value_")]
    assert names
    missing = {}
    for n in names:
        meta = raw.page(n)["meta"]
        commits = {meta["provenance"]["commit"], meta["provenance"]["serving_code"]}
        for c in commits:
            if subprocess.run([*git, "cat-file", "-e", f"{c}^{{commit}}"], capture_output=True).returncode:
                missing[n] = c
    assert not missing, f"archived runs naming no commit of this repository: {missing}"
