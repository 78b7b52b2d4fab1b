"""Cost model (KunServe Eq. 1-3), NNLS fit, profiles, Vidur ingestion."""

import json
from pathlib import Path

import numpy as np
import pytest

from vllm_kunserve.cli.main import main
from vllm_kunserve.policy.costmodel import (CostModel, evaluate, features, features3, fit, fit_with_holdout,
                                            load_profile, nnls_lawson_hanson)

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[1] / "data"
TRUE = CostModel(alpha=2e-6, beta=0.03, gamma=1.5)
# decode attention reads KV: 40x dearer per context token than prefill attention per pair
TRUE_EXT = CostModel(alpha=2e-6, beta=0.03, gamma=1.5, delta=8e-5)


def synth_rows(n=300, noise=0.0, seed=0, truth=TRUE, decode_only=0.0):
    """Random batches of prefill chunks and decodes; a ``decode_only`` share are pure decode steps."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        if rng.random() < decode_only:
            chunks = [(int(rng.integers(1, 8000)), 1) for _ in range(int(rng.integers(1, 128)))]
        else:
            chunks = [(int(rng.integers(0, 4000)), int(rng.integers(1, 2048))) for _ in range(int(rng.integers(1, 6)))]
            chunks += [(int(rng.integers(1, 4000)), 1) for _ in range(int(rng.integers(0, 20)))]  # decodes
        ms = truth.batch_cost(chunks) * (1 + noise * rng.standard_normal())
        rows.append({"chunks": [list(c) for c in chunks], "ms": ms})
    return rows


def test_eq_1_to_3():
    m = CostModel(alpha=1.0, beta=10.0, gamma=100.0)
    assert m.chunk_cost(3, 2) == 1.0 * (6 + 3) + 20 + 100
    b = [(3, 2), (0, 4)]
    assert m.batch_cost(b) == pytest.approx(sum(m.chunk_cost(p, c) for p, c in b) - 100)
    assert features([(0, 1)]) == (1.0, 1.0)
    assert m.form == "paper" and m.delta == 0.0


def test_decode_kv_read_term():
    m = CostModel(alpha=1.0, beta=10.0, gamma=100.0, delta=5.0)
    assert m.form == "extended"
    assert m.chunk_cost(7, 1) == 1.0 * (7 + 1) + 10 + 100 + 5.0 * 7  # one query reads 7 KV tokens
    assert m.chunk_cost(7, 2) == CostModel(1.0, 10.0, 100.0).chunk_cost(7, 2)  # prefill: no delta
    b = [(7, 1), (3, 2), (9, 1)]
    assert features3(b) == (8 + 9 + 10, 4, 16)
    assert m.batch_cost(b) == pytest.approx(sum(m.chunk_cost(p, c) for p, c in b) - 2 * 100)
    assert m.var_cost(7, 1) == m.chunk_cost(7, 1) - 100


def test_extended_fit_recovers_delta_and_paper_form_cannot(tmp_path):
    p = tmp_path / "prof.json"
    p.write_text(json.dumps({"rows": synth_rows(truth=TRUE_EXT, decode_only=0.4)}))
    prof = load_profile(p)
    m = fit(prof, form="extended")
    for k in ("alpha", "beta", "gamma", "delta"):
        assert getattr(m, k) == pytest.approx(getattr(TRUE_EXT, k), rel=1e-6), k
    assert m.meta["form"] == "extended"
    paper = fit(prof)  # the default form is the paper's
    assert paper.delta == 0.0 and paper.form == "paper"
    assert evaluate(paper, prof)["model"]["mean_rel_err"] > 0.05 > 100 * evaluate(m, prof)["model"]["mean_rel_err"]
    # data without decode cost: the extended form finds delta = 0, i.e. the paper's coefficients
    p.write_text(json.dumps({"rows": synth_rows()}))
    m0 = fit(load_profile(p), form="extended")
    assert m0.delta == pytest.approx(0.0, abs=1e-12) and m0.alpha == pytest.approx(TRUE.alpha, rel=1e-6)
    with pytest.raises(ValueError, match="form"):
        fit(prof, form="quadratic")


def test_holdout_report_and_eval_show_both_forms(tmp_path):
    p = tmp_path / "prof.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in synth_rows(400, noise=0.02, truth=TRUE_EXT, decode_only=0.4)))
    prof = load_profile(p)
    m, rep = fit_with_holdout(prof, form="extended")
    assert rep["form"] == "extended" and set(rep["forms"]) == {"paper", "extended"}
    ext, pap = rep["forms"]["extended"]["heldout"], rep["forms"]["paper"]["heldout"]
    assert ext["mean_rel_err"] <= 0.05 < pap["mean_rel_err"]
    assert rep["heldout"]["model"] == ext and rep["heldout"]["forms"]["paper"] == pap
    assert m.meta["forms"]["paper"]["delta"] == 0.0 and m.meta["forms"]["extended"]["delta"] > 0
    out = tmp_path / "m.json"
    m.save(out)
    ev = evaluate(CostModel.load(out), prof)  # the forms travel in the model file
    assert set(ev["forms"]) == {"paper", "extended"}
    assert ev["forms"]["paper"]["mean_rel_err"] > 2 * ev["forms"]["extended"]["mean_rel_err"]


def test_cli_fit_form_and_eval_side_by_side(tmp_path, capsys):
    p = tmp_path / "prof.json"
    p.write_text(json.dumps({"rows": synth_rows(200, truth=TRUE_EXT, decode_only=0.4)}))
    out = tmp_path / "m.json"
    assert main(["costmodel", "fit", str(p), "--out", str(out), "--form", "extended"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["model"]["delta"] == pytest.approx(TRUE_EXT.delta, rel=1e-6)
    assert fitted["forms"]["paper"]["delta"] == 0.0
    assert main(["costmodel", "eval", str(out), str(p)]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["form"] == "extended" and ev["forms"]["extended"]["mean_rel_err"] < 1e-6
    assert ev["forms"]["paper"]["mean_rel_err"] > 0.05
    with pytest.raises(SystemExit):  # argparse rejects an unknown form
        main(["costmodel", "fit", str(p), "--out", str(out), "--form", "cubic"])


def test_fit_recovers_known_coefficients(tmp_path):
    p = tmp_path / "prof.json"
    p.write_text(json.dumps({"rows": synth_rows()}))
    m = fit(load_profile(p))
    assert m.alpha == pytest.approx(TRUE.alpha, rel=1e-6)
    assert m.beta == pytest.approx(TRUE.beta, rel=1e-6)
    assert m.gamma == pytest.approx(TRUE.gamma, rel=1e-6)


def test_noisy_fit_heldout_error_and_beats_token_only(tmp_path):
    p = tmp_path / "prof.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in synth_rows(400, noise=0.03)))
    m, rep = fit_with_holdout(load_profile(p))
    assert rep["heldout"]["model"]["mean_rel_err"] <= 0.05
    assert rep["heldout"]["token_only"]["mean_rel_err"] > 2 * rep["heldout"]["model"]["mean_rel_err"]
    assert m.meta["heldout_mean_rel_err"] == rep["heldout"]["model"]["mean_rel_err"]


def test_fit_never_negative():
    # data generated with a negative intercept: NNLS must clamp gamma at 0, not go below
    rows = [{"chunks": [[0, c]], "ms": 0.01 * c - 0.5} for c in range(100, 2000, 50)]
    from vllm_kunserve.policy.costmodel import Profile

    prof = Profile(tuple(tuple((p, c) for p, c in r["chunks"]) for r in rows), np.array([r["ms"] for r in rows]))
    m = fit(prof, "absolute")
    assert min(m.alpha, m.beta, m.gamma) >= 0 and m.gamma == 0.0


def test_lawson_hanson_matches_kkt():
    rng = np.random.default_rng(1)
    for _ in range(20):
        a = rng.standard_normal((30, 3))
        b = rng.standard_normal(30)
        x = nnls_lawson_hanson(a, b)
        g = a.T @ (a @ x - b)  # gradient
        assert (x >= 0).all()
        assert np.all(g >= -1e-8) and np.allclose(g[x > 1e-12], 0, atol=1e-8)


def test_vidur_mlp_fit_and_eval():
    prof = load_profile(DATA / "vidur_h100_phi2_mlp.csv")
    assert not prof.attention and len(prof) == 131
    m = fit(prof)
    assert m.alpha == 0.0 and m.beta > 0 and m.gamma > 0
    ev = evaluate(m, prof)
    assert ev["model"]["mean_rel_err"] < 0.08
    assert ev["model"]["mean_rel_err"] < ev["token_only"]["mean_rel_err"] / 2


def test_profile_errors_name_the_field(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"rows": [{"chunks": [[0, 5]]}]}))
    with pytest.raises(ValueError, match=r"rows\[0\]\.ms: missing required field"):
        load_profile(p)
    p.write_text(json.dumps({"rows": [{"chunks": [[0, "x"]], "ms": 1}]}))
    with pytest.raises(ValueError, match=r"chunks\[0\]"):
        load_profile(p)
    p = tmp_path / "bad.jsonl"
    p.write_text('{"chunks": [[0, 1]], "ms": 1}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_profile(p)
    with pytest.raises(FileNotFoundError):
        load_profile(tmp_path / "nope.json")


def test_model_roundtrip(tmp_path):
    p = tmp_path / "m.json"
    TRUE.save(p)
    assert CostModel.load(p) == TRUE
    TRUE_EXT.save(p)
    assert CostModel.load(p) == TRUE_EXT


def test_model_file_without_delta_loads_as_paper_form(tmp_path):
    p = tmp_path / "old.json"  # written before delta existed
    p.write_text(json.dumps({"alpha": 2e-6, "beta": 0.03, "gamma": 1.5, "unit": "ms",
                             "token_only_per_token": 0.05, "meta": {"profile": "x"}}))
    m = CostModel.load(p)
    assert (m.alpha, m.beta, m.gamma, m.delta, m.form) == (TRUE.alpha, TRUE.beta, TRUE.gamma, 0.0, "paper")
    prof = load_profile(_write(tmp_path, synth_rows(50)))
    ev = evaluate(m, prof)
    assert "forms" not in ev and ev["model"]["mean_rel_err"] < 1e-9
    p.write_text('{"alpha": 1, "beta": 1, "gamma": 0, "delta": -1}')
    with pytest.raises(ValueError, match="delta"):
        CostModel.load(p)


def _write(tmp_path, rows):
    p = tmp_path / "rows.json"
    p.write_text(json.dumps({"rows": rows}))
    return p
    p.write_text('{"alpha": 1, "beta": -1, "gamma": 0}')
    with pytest.raises(ValueError, match="beta"):
        CostModel.load(p)
