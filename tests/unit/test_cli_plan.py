"""``kunserve plan ...`` and ``kunserve costmodel ...`` end to end through main()."""

import io
import json
from pathlib import Path

import pytest

from vllm_kunserve.cli.main import main

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data"
MODEL = {"num_layers": 8, "layer_bytes": 1000, "block_bytes": 10}


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return str(p)


def test_plan_drop(tmp_path, capsys):
    inp = {"cluster": {"model": MODEL, "instances": [
        {"instance_id": i, "kv_blocks_total": 1000, "kv_blocks_used": 1000, "queued_blocks": 500} for i in range(4)]},
        "config": {"drop": {"headroom_ratio": 0.0, "forecast_horizon_s": 0.0}}}
    out = run_json(capsys, ["plan", "drop", write(tmp_path, "d.json", inp)])
    assert out["overload"]["overloaded"] and out["overload"]["need_bytes"] == 2000 * 10
    plan = out["plan"]
    assert plan["satisfied"] and plan["freed_bytes"] == 3 * 8 * 1000 >= 20000
    assert len(plan["merges"]) == 3


def test_plan_drop_merges_a_live_group_further_only_with_drop_regroup(tmp_path, capsys):
    insts = [{"instance_id": i, "kv_blocks_total": 1000, "kv_blocks_used": 1000, "queued_blocks": 900,
              **({"layer_start": 4 * i, "layer_end": 4 * i + 4} if i < 2 else {})} for i in range(4)]
    inp = {"cluster": {"model": MODEL, "instances": insts, "groups": [[0, 1], [2], [3]]},
           "config": {"drop": {"headroom_ratio": 0.0, "forecast_horizon_s": 0.0}}}
    plan = run_json(capsys, ["plan", "drop", write(tmp_path, "d.json", inp)])["plan"]
    assert plan["merges"] == [[[2], [3]]] and plan["unchanged_groups"] == [[0, 1]] and not plan["satisfied"]
    inp["config"]["drop"]["regroup"] = True
    plan = run_json(capsys, ["plan", "drop", write(tmp_path, "d.json", inp)])["plan"]
    assert plan["merges"] == [[[2], [3]], [[0, 1], [2, 3]]] and plan["unchanged_groups"] == []
    assert [sorted(g["instances"]) for g in plan["groups"]] == [[0, 1, 2, 3]]


def test_plan_drop_from_stdin(monkeypatch, capsys):
    inp = {"cluster": {"model": MODEL, "instances": [{"instance_id": 0, "kv_blocks_total": 10, "kv_blocks_used": 1}]}}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(inp)))
    out = run_json(capsys, ["plan", "drop", "-"])
    assert out["plan"] is None and not out["overload"]["overloaded"]


def test_plan_restore(tmp_path, capsys):
    inp = {"cluster": {"model": MODEL, "now_s": 10.0, "groups": [[0, 1]], "instances": [
        {"instance_id": 0, "kv_blocks_total": 1400, "kv_blocks_used": 100, "layer_start": 0, "layer_end": 4},
        {"instance_id": 1, "kv_blocks_total": 1400, "kv_blocks_used": 100, "layer_start": 4, "layer_end": 8}]},
        "state": {"below_since": 1.0}}
    out = run_json(capsys, ["plan", "restore", write(tmp_path, "r.json", inp)])
    assert out["decision"]["restore"][0]["instances"] == [0, 1]


def test_plan_microbatch(tmp_path, capsys):
    inp = {"requests": [{"request_id": "a", "prompt_tokens": 3000}, {"request_id": "b", "prompt_tokens": 50,
                                                                     "computed_tokens": 50, "generated_tokens": 3}],
           "parts": 4, "min_tokens": 16}
    out = run_json(capsys, ["plan", "microbatch", write(tmp_path, "m.json", inp)])
    assert out["method"] == "lookahead" and len(out["microbatches"]) == 4
    assert sum(mb["tokens"] for mb in out["microbatches"]) == 3001
    assert out["bubble"] <= out["other_method_bubble"]


def test_plan_remap_placement_migrate_chunk(tmp_path, capsys):
    remap = {"models": [{"name": "m", "num_layers": 32, "layer_bytes": 1 << 29, "decode_ms": 1.0,
                         "prefill_ms": 3.0}], "h2d_bytes_per_s": 1e11, "kv_shortage_bytes": 1 << 30}
    out = run_json(capsys, ["plan", "remap", write(tmp_path, "x.json", remap)])
    assert out["plan"]["action"] == "remap" and out["plan"]["models"][0]["alpha"] == 2
    place = {"capacity": 100, "ops": [{"op": "allocate", "request_id": "a", "size": 60},
                                      {"op": "allocate", "request_id": "b", "size": 30},
                                      {"op": "update", "request_id": "b", "size": 45},
                                      {"op": "depart", "request_id": "a"}]}
    out = run_json(capsys, ["plan", "placement", write(tmp_path, "p.json", place)])
    assert out["instances_used"] == 1 and out["lower_bound"] == 1 and len(out["results"]) == 4
    mig = {"candidates": [{"request_id": "r", "src": 0, "dst": 1, "kv_bytes": 1e6, "tokens": 10}],
           "link_budget_bytes": [{"src": 0, "dst": 1, "bytes": 1e9}], "link_bytes_per_s": 1e10}
    out = run_json(capsys, ["plan", "migrate", write(tmp_path, "g.json", mig)])
    assert out["choices"][0]["method"] in ("kv", "reprefill")
    out = run_json(capsys, ["plan", "chunk", write(tmp_path, "c.json", {"link_bytes_per_s": 1e10,
                                                                       "stage_time_s": 0.002})])
    assert out["chunk_bytes"] == 20_000_000


@pytest.mark.parametrize("kind,doc,msg", [
    ("drop", "{not json", "not valid JSON"),
    ("drop", {"cluster": {"model": MODEL}}, "cluster.instances: missing required field"),
    ("microbatch", {"requests": [{"request_id": "a"}]}, "requests\\[0\\].prompt_tokens: missing"),
    ("placement", {"ops": []}, "capacity: missing required field"),
    ("placement", {"capacity": 10, "ops": [{"op": "fly", "request_id": "a"}]}, "ops\\[0\\].op='fly'"),
    ("chunk", {"link_bytes_per_s": "fast", "stage_time_s": 1}, "link_bytes_per_s='fast'"),
    ("drop", {"cluster": {}, "config": {"drop": {"nope": 1}}}, "kunserve.drop.nope: unknown key"),
])
def test_bad_input_is_one_clear_line(tmp_path, capsys, kind, doc, msg):
    assert main(["plan", kind, write(tmp_path, "bad.json", doc)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and pytest.importorskip("re").search(msg, err), err


def test_missing_input_file(capsys):
    assert main(["plan", "drop", "/nonexistent/x.json"]) == 2
    assert "no such input file" in capsys.readouterr().err


def test_costmodel_fit_and_eval_vidur(tmp_path, capsys):
    out_path = tmp_path / "model.json"
    prof = str(DATA / "vidur_h100_phi2_mlp.csv")
    fitted = run_json(capsys, ["costmodel", "fit", prof, "--out", str(out_path)])
    assert out_path.exists() and fitted["model"]["beta"] > 0
    assert fitted["heldout"]["model"]["mean_rel_err"] < fitted["heldout"]["token_only"]["mean_rel_err"]
    ev = run_json(capsys, ["costmodel", "eval", str(out_path), prof])
    assert set(ev) >= {"model", "token_only", "rows"} and ev["rows"] == 131
    assert ev["model"]["max_rel_err"] >= ev["model"]["mean_rel_err"] > 0


def test_costmodel_json_profile_and_errors(tmp_path, capsys):
    rows = [{"chunks": [[p, c]], "ms": 1e-6 * (p * c + (c * c + c) / 2) + 0.01 * c + 2}
            for p in (0, 500, 3000) for c in (1, 64, 512, 2048)]
    prof = write(tmp_path, "p.json", {"rows": rows})
    out = run_json(capsys, ["costmodel", "fit", prof, "--out", str(tmp_path / "m.json")])
    assert out["model"]["alpha"] == pytest.approx(1e-6, rel=1e-4)
    assert main(["costmodel", "fit", write(tmp_path, "b.json", {"rows": [{"ms": 1}]}), "--out",
                 str(tmp_path / "z.json")]) == 2
    assert "rows[0].chunks: missing required field" in capsys.readouterr().err
    assert main(["costmodel", "eval", str(tmp_path / "missing.json"), prof]) == 2
