"""The kunserve endpoint plugin (integration/vllm/endpoint.py): ``GET /kunserve/engine`` on vllm
serve names the engine's control port, announced by the engine core through a file the API server's
activation gate names (plugin.py)."""

import os

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_kunserve import plugin
from vllm_kunserve.engine.control import ANNOUNCE_ENV
from vllm_kunserve.integration.vllm import endpoint

pytestmark = pytest.mark.unit


@pytest.fixture
def app():
    a = FastAPI()
    p = endpoint.KunserveEndpoint()
    assert p.name == "kunserve" and p.required_tasks is None
    p.attach_router(a)
    return TestClient(a)


def test_route_answers_what_the_engine_core_announced(app, tmp_path, monkeypatch):
    monkeypatch.delenv(ANNOUNCE_ENV, raising=False)
    r = app.get("/kunserve/engine")
    assert r.status_code == 404 and "stock engine" in r.json()["error"]   # no kunserve key: nothing named
    monkeypatch.setenv(ANNOUNCE_ENV, str(tmp_path / "a.json"))
    assert app.get("/kunserve/engine").status_code == 503            # named, not announced yet
    assert endpoint.announce("http://127.0.0.1:4242") == tmp_path / "a.json"
    r = app.get("/kunserve/engine")
    assert r.status_code == 200 and r.json() == {"control_url": "http://127.0.0.1:4242"}
    assert sorted(os.listdir(tmp_path)) == ["a.json"]                 # written whole, no temp left
    (tmp_path / "a.json").write_text("{not json")
    assert app.get("/kunserve/engine").status_code == 500


def test_each_kunserve_engine_built_gets_its_own_announce_file(monkeypatch):
    from vllm_kunserve.config import parse_config

    member = parse_config({"drop": {"group_member": True}})
    monkeypatch.delenv(ANNOUNCE_ENV, raising=False)
    plugin._name_announce(member)
    first = os.environ[ANNOUNCE_ENV]
    plugin._name_announce(member)
    assert os.environ[ANNOUNCE_ENV] != first and str(os.getpid()) in first
    # an engine that opens no control port names none: its route answers 404 at once, not 503
    for cfg in (None, parse_config({}), parse_config({"drop": {"group_member": True}, "control": {"enable": False}})):
        plugin._name_announce(member)
        plugin._name_announce(cfg)
        assert ANNOUNCE_ENV not in os.environ
    assert endpoint.ANNOUNCE_ENV == ANNOUNCE_ENV


def test_no_file_is_written_where_no_engine_asked(monkeypatch):
    monkeypatch.delenv(ANNOUNCE_ENV, raising=False)
    assert endpoint.announce("http://127.0.0.1:1") is None
