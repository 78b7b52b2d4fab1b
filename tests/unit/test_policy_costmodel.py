"""Cost model (KunServe Eq. 1-3), NNLS fit, profiles, Vidur ingestion."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from vllm_kunserve.cli.main import main
from vllm_kunserve.policy.costmodel import (FORMS, CostModel, Profile, evaluate, features, features3, fit,
                                            fit_with_holdout, load_profile, nnls_lawson_hanson, predict,
                                            select_form)

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
    assert rep["form"] == "extended" and set(rep["forms"]) == {"paper", "extended", "roofline"}
    ext, pap = rep["forms"]["extended"]["heldout"], rep["forms"]["paper"]["heldout"]
    assert ext["mean_rel_err"] <= 0.05 < pap["mean_rel_err"]
    assert rep["heldout"]["model"] == ext and rep["heldout"]["forms"]["paper"] == pap
    assert m.meta["forms"]["paper"]["delta"] == 0.0 and m.meta["forms"]["extended"]["delta"] > 0
    out = tmp_path / "m.json"
    m.save(out)
    ev = evaluate(CostModel.load(out), prof)  # the forms travel in the model file
    assert set(ev["forms"]) == {"paper", "extended", "roofline"}
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
    assert m.form == "paper" and (m.floor, m.beta_floor, m.tile) == (0.0, 0.0, 1)
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


# ---------------------------------------------------------------------------------------------
# roofline form: T(B) = beta_floor * B + max(floor, (beta - beta_floor) * pad(B))

# knee = floor / (beta - beta_floor) = 4.0 / 0.014 = 285.7 tokens
TRUE_ROOF = CostModel(alpha=2e-6, beta=0.015, gamma=0.5, delta=8e-5, floor=4.0, beta_floor=0.001)


def roof_rows(n=400, noise=0.0, seed=0, truth=TRUE_ROOF):
    """Batches from 1 to ~6k tokens, a third of them below the knee: small prefills, decode
    batches and mixes, so that alpha, delta and the floor are all identifiable."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        kind = i % 3
        if kind == 0:  # small: one short prefill and/or a few decodes
            chunks = [(int(rng.integers(0, 3000)), int(rng.integers(1, 200)))]
            chunks += [(int(rng.integers(1, 8000)), 1) for _ in range(int(rng.integers(0, 30)))]
        elif kind == 1:  # decode batch
            chunks = [(int(rng.integers(1, 8000)), 1) for _ in range(int(rng.integers(1, 400)))]
        else:  # big prefills plus decodes
            chunks = [(int(rng.integers(0, 4000)), int(rng.integers(64, 2048))) for _ in range(int(rng.integers(1, 4)))]
            chunks += [(int(rng.integers(1, 4000)), 1) for _ in range(int(rng.integers(0, 20)))]
        rows.append((tuple(chunks), truth.batch_cost(chunks) * (1 + noise * rng.standard_normal())))
    return Profile(tuple(c for c, _ in rows), np.array([m for _, m in rows]), True, "synthetic-roofline")


def test_roofline_cost_floor_paid_once_per_batch():
    m = CostModel(alpha=1e-3, beta=2.0, gamma=10.0, delta=0.5, floor=100.0, beta_floor=1.0)
    assert m.form == "roofline" and m.knee == 100.0
    # below the knee the token term is the floor (+ beta_floor per token), above it beta per token
    assert m.token_cost(40) == pytest.approx(1.0 * 40 + 100.0)
    assert m.token_cost(300) == pytest.approx(2.0 * 300)
    assert m.token_cost(100) == pytest.approx(200.0)  # continuous at the knee
    b = [(500, 1), (0, 30), (7, 1)]
    a, toks, d = features3(b)
    assert m.batch_cost(b) == pytest.approx(1e-3 * a + 10.0 + 0.5 * d + 1.0 * toks + 100.0)
    # var_cost stays additive; gamma and the floor top-up are paid once per batch
    assert m.batch_cost(b) == pytest.approx(10.0 + m.batch_overhead(toks) + sum(m.var_cost(p, c) for p, c in b))
    assert m.chunk_cost(0, 30) == pytest.approx(m.batch_cost([(0, 30)]))
    assert sum(m.chunk_cost(p, c) for p, c in b) - 2 * 10.0 > m.batch_cost(b) + 150  # alone, each paid the floor
    # above the knee Eq. 3 holds again: the batch pays no top-up
    big = [(0, 200), (100, 150)]
    assert m.batch_overhead(350) == 0.0
    assert m.batch_cost(big) == pytest.approx(sum(m.chunk_cost(p, c) for p, c in big) - 10.0)
    # the linear forms have exactly no overhead
    assert CostModel(1.0, 2.0, 3.0).batch_overhead(5) == 0.0 and CostModel(1.0, 2.0, 3.0).knee == 0.0


def test_roofline_tile_padding():
    m = CostModel(alpha=0.0, beta=1.0, gamma=0.0, tile=128)
    assert m.form == "roofline"
    assert m.batch_cost([(0, 128)]) == 128.0
    assert m.batch_cost([(0, 129)]) == 256.0  # a second 128-row tile
    assert m.batch_cost([(0, 100), (0, 29)]) == 256.0  # the batch is padded, not each chunk
    assert m.var_cost(0, 129) == 129.0 and m.batch_overhead(129) == 127.0


def test_roofline_fit_recovers_known_parameters():
    prof = roof_rows()
    m = fit(prof, form="roofline")
    assert m.form == "roofline" and m.tile == 1 and m.meta["form"] == "roofline"
    for k in ("alpha", "beta", "gamma", "delta", "floor", "beta_floor"):
        assert getattr(m, k) == pytest.approx(getattr(TRUE_ROOF, k), rel=1e-6), k
    assert m.knee == pytest.approx(4.0 / 0.014, rel=1e-6)
    assert evaluate(m, prof)["model"]["max_rel_err"] < 1e-8
    # the linear forms cannot bend around the knee
    ext = evaluate(fit(prof, form="extended"), prof)["model"]
    assert ext["mean_rel_err"] > 0.05 and ext["max_rel_err"] > 0.25


def test_roofline_fit_recovers_tile():
    truth = CostModel(alpha=0.0, beta=3e-4, gamma=0.02, floor=0.03, beta_floor=1e-4, tile=64)
    b = list(range(1, 64)) + list(range(64, 4097, 8))
    prof = Profile(tuple(((0, n),) for n in b), np.array([truth.batch_cost([(0, n)]) for n in b]), False, "tile64")
    m = fit(prof, form="roofline")
    assert m.tile == 64 and m.floor == pytest.approx(0.03, rel=1e-6) and m.beta == pytest.approx(3e-4, rel=1e-6)
    assert evaluate(m, prof)["model"]["max_rel_err"] < 1e-8
    assert fit(prof, form="roofline", tiles=(1,)).tile == 1  # tile search can be switched off


def test_roofline_noisy_heldout_and_auto_choice():
    prof = roof_rows(500, noise=0.03, seed=3)
    m, rep = fit_with_holdout(prof)  # default: auto, chosen by CV on the training rows only
    assert rep["form"] == "roofline" and m.form == "roofline" and rep["requested_form"] == "auto"
    assert set(rep["cv_mean_rel_err"]) == set(FORMS)
    held = {f: v["heldout"]["mean_rel_err"] for f, v in rep["forms"].items()}
    assert held["roofline"] <= 0.05 < held["extended"] < held["paper"]
    assert rep["heldout"]["model"]["mean_rel_err"] == held["roofline"]
    assert m.meta["selected_by"].startswith("5-fold")
    # paper-form data: every form fits exactly and the tie goes to the simplest
    form, cv = select_form(load_profile_rows(synth_rows(120)))
    assert form == "paper" and max(cv.values()) < 1e-6
    assert fit(load_profile_rows(synth_rows(120)), form="auto").form == "paper"
    with pytest.raises(ValueError, match="form"):
        fit_with_holdout(prof, form="cubic")


def load_profile_rows(rows):
    return Profile(tuple(tuple((p, c) for p, c in r["chunks"]) for r in rows), np.array([r["ms"] for r in rows]))


def test_roofline_serialisation_roundtrip(tmp_path):
    p = tmp_path / "m.json"
    m = CostModel(alpha=2e-6, beta=0.015, gamma=0.5, delta=8e-5, floor=3.0, beta_floor=0.003, tile=64)
    m.save(p)
    back = CostModel.load(p)
    assert back == m and back.form == "roofline" and back.tile == 64
    assert back.batch_cost([(10, 5), (300, 1)]) == m.batch_cost([(10, 5), (300, 1)])
    assert CostModel.from_dict(m.to_dict()) == m
    for bad, field in (({"beta_floor": 0.02}, "beta_floor"), ({"tile": 0}, "tile"), ({"tile": 1.5}, "tile"),
                       ({"floor": -1.0}, "floor")):
        with pytest.raises(ValueError, match=field):
            CostModel.from_dict({**m.to_dict(), **bad})
    # a fitted model file carries every form, the roofline's knee and tile included
    prof = roof_rows(200, noise=0.01)
    fitted, _ = fit_with_holdout(prof)
    fitted.save(p)
    ev = evaluate(CostModel.load(p), prof)
    assert set(ev["forms"]) == set(FORMS) and ev["form"] == "roofline"
    assert ev["forms"]["roofline"] == ev["model"]
    assert ev["forms"]["roofline"]["mean_rel_err"] < ev["forms"]["extended"]["mean_rel_err"] / 3


def test_beta_must_be_non_negative(tmp_path):
    p = tmp_path / "m.json"
    p.write_text('{"alpha": 1, "beta": -1, "gamma": 0}')
    with pytest.raises(ValueError, match="beta"):
        CostModel.load(p)


def test_roofline_on_vidur_slice_where_the_linear_form_misses():
    """Vidur H100 phi-2 (131-row slice in tests/data), 5-fold cross-validated (every row scored by
    a fit that did not see it): the linear forms miss 5%, the roofline (128-row GEMM tiles: flat
    up to 128 tokens, steps at the tile boundaries) does not, and auto picks it."""
    prof = load_profile(DATA / "vidur_h100_phi2_mlp.csv")
    form, cv = select_form(prof)
    assert cv["paper"] > 0.05 and cv["extended"] > 0.05
    assert cv["roofline"] <= 0.05 and form == "roofline"
    m = fit(prof, form="auto")
    assert m.form == "roofline" and m.tile == 128 and m.alpha == 0.0 and m.delta == 0.0  # no attention timed
    assert m.meta["cv_mean_rel_err"] == cv


SHARED = (Path(os.environ.get("KUNSERVE_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
          / "profiles" / "vidur" / "h100" / "meta-llama" / "Llama-2-70b-hf" / "mlp.csv")


@pytest.mark.skipif(not SHARED.exists(), reason="shared Vidur profiles not present")
def test_roofline_on_full_vidur_profile_heldout():
    """Vidur H100 Llama-2-70B TP1, held-out 20%: linear 6.7%, roofline under 5%."""
    m, rep = fit_with_holdout(load_profile(SHARED, tp=1))
    held = {f: v["heldout"]["mean_rel_err"] for f, v in rep["forms"].items()}
    assert held["paper"] > 0.05 and held["extended"] > 0.05
    assert rep["form"] == "roofline" and held["roofline"] <= 0.05
    assert rep["heldout"]["model"]["mean_rel_err"] == held["roofline"]
    assert m.floor > 0 and 64 < m.knee < 512  # weight-read bound below a few hundred tokens


def test_separately_measured_test_profile():
    train, test = roof_rows(300, noise=0.02, seed=5), roof_rows(100, noise=0.02, seed=6)
    m, rep = fit_with_holdout(train, form="roofline", test=test)
    assert rep["heldout"]["rows"] == 100 and rep["train"]["rows"] == 300 and rep["holdout"] is None
    assert rep["scored_on"].startswith("separate profile")
    assert rep["heldout"]["model"]["mean_rel_err"] <= 0.05


def test_microbatcher_with_a_roofline_model():
    from vllm_kunserve.policy.microbatch import WorkChunk, lookahead_microbatches

    m = CostModel(alpha=2e-6, beta=0.015, gamma=0.5, delta=8e-5, floor=3.0, beta_floor=0.003, tile=16)
    work = [WorkChunk("p0", 0, 3000), WorkChunk("p1", 500, 700)] + [WorkChunk(f"d{i}", 2000, 1, True) for i in range(40)]
    mbs = lookahead_microbatches(work, m, 4)
    assert len(mbs) == 4
    for mb in mbs:  # Microbatch.cost is the roofline batch cost: floor and gamma once per microbatch
        assert mb.cost == pytest.approx(m.batch_cost((c.prefix, c.tokens) for c in mb.chunks))
    toks = {}
    for mb in mbs:
        for c in mb.chunks:
            toks[c.request_id] = toks.get(c.request_id, 0) + c.tokens
    assert toks["p0"] == 3000 and toks["p1"] == 700 and sum(toks.values()) == 3740
    costs = [mb.cost for mb in mbs]
    assert max(costs) / min(costs) < 1.1  # balanced above the knee
    assert predict(m, Profile(tuple(tuple((c.prefix, c.tokens) for c in mb.chunks) for mb in mbs),
                              np.ones(4))) == pytest.approx(costs)
