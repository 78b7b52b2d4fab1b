"""benchmarks/sim_regroup.py: its input checks, the rows it rebuilds from sim_burstiness's arguments,
and the summary its page states."""

import json

import pytest

from tests.unit.benchmod import load_benchmark

pytestmark = pytest.mark.unit

sr = load_benchmark("sim_regroup")

SOURCE = {"command": "python benchmarks/sim_burstiness.py",
          "args": {"cvs": [1.0, 8.0], "demands": [0.5, 0.8], "window_s": 300.0, "warmup_s": 300.0, "seed": 3,
                   "real": ["azure"]},
          "rows": [{"row": "gamma-cv1"}, {"row": "gamma-cv8"}, {"row": "azure", "offset_s": 1980.0}],
          "cells": [{"row": r, "demand": d} for r in ("gamma-cv1", "gamma-cv8", "azure") for d in (0.5, 0.8)]}


def write(tmp_path, obj) -> str:
    p = tmp_path / "cells.json"
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


def test_rows_and_columns_default_to_the_cells_and_are_checked(tmp_path):
    a = sr.parse_args(["--cells", write(tmp_path, SOURCE)])
    assert a.rows == ["azure", "gamma-cv1", "gamma-cv8"] and a.demands == [0.5, 0.8]
    a = sr.parse_args(["--cells", write(tmp_path, SOURCE), "--rows", "azure", "--demands", "0.8"])
    assert a.rows == ["azure"] and a.demands == [0.8]
    for argv, needle in ((["--rows", "mooncake"], "mooncake; the cells have azure"),
                         (["--demands", "0.6"], "[0.6] not among")):
        with pytest.raises(SystemExit, match=needle.replace("[", r"\[").replace("]", r"\]")):
            sr.parse_args(["--cells", write(tmp_path, SOURCE), *argv])


@pytest.mark.parametrize("content, needle", [(None, "no such file"), ("{", "not valid JSON"),
                                             ({"cells": []}, "not a sim_burstiness.json")])
def test_a_missing_or_wrong_cells_file_is_one_line(tmp_path, content, needle):
    path = str(tmp_path / "none.json") if content is None else write(tmp_path, content)
    with pytest.raises(SystemExit, match=needle):
        sr.parse_args(["--cells", path])


def test_the_source_rows_are_rebuilt_with_their_offsets_pinned():
    a = sr.source_args(SOURCE)
    assert a.cvs == [1.0, 8.0] and a.seed == 3 and a.real == ["azure"] and a.azure_offset == 1980.0
    assert a.window_s == 300.0 and a.warmup_s == 300.0 and a.mooncake_offset is None


def cell(row, k, rg, kv, eq8, regroups=1):
    v = {"kunserve": {"p99_ttft_s": k, "regroups": 0}, "regroup": {"p99_ttft_s": rg, "regroups": regroups},
         "regroup-kv": {"p99_ttft_s": kv, "regroups": regroups}}
    return {"row": row, "demand": 0.5, "variants": v, "agrees_with_stored": True,
            "stored_p99_ttft_s": {"oracle-equal-g8": eq8}}


def test_the_summary_counts_only_cells_with_room_for_a_larger_group():
    cells = [cell("a", 1.0, 2.0, 0.8, 0.5), cell("b", 2.0, 1.0, 1.5, 1.0),
             cell("c", 1.0, 3.0, 0.5, 0.95, regroups=0)]   # within 1.1x of eq-g8: no room, not counted
    s = sr.summary(cells)
    assert s["cells"] == 3 and s["cells_with_room"] == 2 and s["all_agree_with_stored"]
    assert s["regroup"] == {"better": 1, "worse": 1, "median_ratio": 2.0, "regrouped_cells": 2}
    assert s["regroup-kv"] == {"better": 2, "worse": 0, "median_ratio": 0.8, "regrouped_cells": 2}
    cells[0]["agrees_with_stored"] = False
    assert sr.summary(cells)["all_agree_with_stored"] is False
