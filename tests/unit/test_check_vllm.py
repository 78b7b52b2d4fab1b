"""``scripts/check_vllm.py`` (``make check-vllm``) over tiny fake vLLM sdists: symbols resolve through
imports and base classes, params and attrs are checked and named when wrong, version branches are
checked on their releases only, and a release that cannot be downloaded is reported, not a crash.
No network: every test builds its sdists in ``tmp_path`` (or fakes ``urlopen``)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_vllm.py"

FILES = {
    "vllm/__init__.py": "",
    "vllm/engine/__init__.py": "from .core import Core\n",
    "vllm/engine/base.py": (
        "class Base:\n"
        "    def __init__(self):\n"
        "        self.from_base = 1\n"
        "        self.a, self.b = 1, 2\n"
        "    def shutdown(self, timeout=None):\n"
        "        pass\n"),
    "vllm/engine/kv_utils.py": "def get_configs(vllm_config, specs, memory):\n    return []\n",
    "vllm/engine/core.py": (
        "from typing import TYPE_CHECKING\n"
        "from vllm.engine import base\n"
        "from .kv_utils import get_configs as get_kv_configs\n"
        "if TYPE_CHECKING:\n"
        "    from torch import Tensor\n"
        "class Core(base.Base):\n"
        "    field: int = 0\n"
        "    def __init__(self, cfg):\n"
        "        super().__init__()\n"
        "        self.cfg = cfg\n"
        "    def step(self, batch, *, timeout=None):\n"
        "        pass\n"
        "    def rpc(self, method, timeout, args):\n"
        "        pass\n"
        "    @property\n"
        "    def busy(self):\n"
        "        return False\n"),
}


@pytest.fixture(scope="module")
def cv():
    spec = importlib.util.spec_from_file_location("check_vllm_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def V(cv, monkeypatch):
    """The real versions module with the test's own touchpoints (``V.declare(...)``)."""
    v = cv.load_versions()
    monkeypatch.setattr(v, "declare", lambda *tps: monkeypatch.setattr(v, "TOUCHPOINTS", tuple(tps)), raising=False)
    return v


def tar_bytes(ver: str, files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, text in {**files, "setup.py": "", "csrc/x.cu": ""}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{ver}/{path}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sdist(cache: Path, ver: str, files: dict[str, str] = FILES) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    p = cache / f"vllm-{ver}.tar.gz"
    p.write_bytes(tar_bytes(ver, files))
    return p


def problems(cv, V, tmp_path, *symbols, ver="0.32.0", files=FILES):
    V.declare(V.Touchpoint("t", "T", tuple(symbols)))
    src = cv.Source.from_sdist(sdist(tmp_path / "cache", ver, files))
    res = cv.check_release(src, ver, V)["t"]
    return res if res == "-" else [p for p, _ in res]


def test_a_method_is_found_with_its_leading_params(cv, V, tmp_path):
    assert problems(cv, V, tmp_path,
                    V.Symbol("vllm.engine.core:Core.step", params=("self", "batch", "timeout")),
                    V.Symbol("vllm.engine:Core.step", params=("self", "batch")),   # through the package's import
                    V.Symbol("vllm.engine.core:Core.shutdown", params=("self", "timeout")),   # a base's method
                    V.Symbol("vllm.engine.core:Core"), V.Symbol("vllm.engine.base")) == []


def test_a_function_imported_into_a_module_is_checked_where_it_is_defined(cv, V, tmp_path):
    assert problems(cv, V, tmp_path, V.Symbol("vllm.engine.core:get_kv_configs",
                                              params=("vllm_config", "specs", "memory"))) == []
    (p,) = problems(cv, V, tmp_path, V.Symbol("vllm.engine.core:get_kv_configs", params=("vllm_config", "kv")))
    assert p == ("vllm.engine.core:get_kv_configs params (vllm_config, specs, memory) do not start with "
                 "(vllm_config, kv)")


def test_a_params_mismatch_names_the_symbol_and_both_shapes(cv, V, tmp_path):
    (p,) = problems(cv, V, tmp_path,
                    V.Symbol("vllm.engine.core:Core.rpc", params=("self", "method", "timeout", "args", "kwargs")))
    assert p == ("vllm.engine.core:Core.rpc params (self, method, timeout, args) do not start with "
                 "(self, method, timeout, args, kwargs)")


def test_missing_names_are_reported_by_name(cv, V, tmp_path):
    got = problems(cv, V, tmp_path,
                   V.Symbol("vllm.engine.core:Core", attrs=("cfg", "nope", "field", "also_nope")),
                   V.Symbol("vllm.engine.core:Core.gone"),
                   V.Symbol("vllm.engine.core:missing_fn"),
                   V.Symbol("vllm.engine.nowhere:X"))
    assert got == ["vllm.engine.core:Core attrs missing: nope, also_nope",
                   "vllm.engine.core:Core.gone: gone not found in vllm.engine.core:Core (nor its vLLM bases)",
                   "vllm.engine.core:missing_fn: missing_fn not found in vllm.engine.core",
                   "vllm.engine.nowhere:X: module vllm.engine.nowhere not found"]


def test_attrs_are_found_in_base_classes_properties_and_fields(cv, V, tmp_path):
    assert problems(cv, V, tmp_path, V.Symbol("vllm.engine.core:Core", attrs=(
        "from_base", "a", "b", "shutdown", "busy", "field", "cfg", "step"))) == []


def test_a_version_branch_is_checked_on_its_releases_only(cv, V, tmp_path, capsys):
    old = {**FILES, "vllm/engine/core.py": FILES["vllm/engine/core.py"].replace(
        "def rpc(self, method, timeout, args)", "def rpc(self, method)")}
    V.declare(V.Touchpoint("t", "T", (
        V.Symbol("vllm.engine.core:Core.rpc", params=("self", "method"), versions=">=0.26,<0.28"),
        V.Symbol("vllm.engine.core:Core.rpc", params=("self", "method", "timeout", "args"),
                 versions=">=0.28,<0.35"))),
        V.Touchpoint("late", "L", (V.Symbol("vllm.engine.core:Core.nope"),), versions=">=0.32,<0.35"))
    cache = tmp_path / "cache"
    sdist(cache, "0.26.0", old)
    sdist(cache, "0.32.0")
    assert cv.run(V, ["0.26.0", "0.32.0"], cache, json_out=tmp_path / "m.json") == 1   # "late" fails on 0.32.0
    out = json.loads((tmp_path / "m.json").read_text())
    assert out["cells"] == {"t": {"0.26.0": "ok", "0.32.0": "ok"}, "late": {"0.26.0": "-", "0.32.0": "FAIL"}}
    assert [(p["release"], p["touchpoint"]) for p in out["problems"]] == [("0.32.0", "late")]
    # the new shape on the old release would have failed: the branch is what kept 0.26.0 green
    V.declare(V.Touchpoint("t", "T", (V.Symbol("vllm.engine.core:Core.rpc", params=("self", "method", "timeout")),)))
    assert cv.run(V, ["0.26.0", "0.32.0"], cache) == 1
    assert "0.26.0 t: vllm.engine.core:Core.rpc params (self, method) do not start with" in capsys.readouterr().out


def test_an_optional_symbol_warns_and_passes(cv, V, tmp_path, capsys):
    V.declare(V.Touchpoint("t", "T", (V.Symbol("vllm.engine.core:Core", attrs=("later",), optional=True),)))
    sdist(tmp_path / "cache", "0.32.0")
    assert cv.run(V, ["0.32.0"], tmp_path / "cache") == 0
    out = capsys.readouterr().out
    assert "warn" in out and "0.32.0 t: vllm.engine.core:Core attrs missing: later" in out


def test_no_network_and_an_empty_cache_is_reported_per_release_not_a_crash(cv, V, tmp_path, monkeypatch, capsys):
    def offline(*a, **k):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    V.declare(V.Touchpoint("t", "T", (V.Symbol("vllm.engine.core:Core"),)))
    sdist(tmp_path / "cache", "0.32.0")   # one release cached: checked without the network
    assert cv.run(V, ["0.26.0", "0.32.0"], tmp_path / "cache") == 1
    out = capsys.readouterr().out
    assert "vllm 0.26.0: not in the cache and cannot download (URLError: <urlopen error no network>)" in out
    assert [ln.split() for ln in out.splitlines() if ln.startswith("t ")] == [["t", "n/c", "ok"]]
    assert cv.run(V, ["0.26.0", "0.32.0"], tmp_path / "cache", allow_missing=True) == 0
    assert not list((tmp_path / "cache").glob("*.part"))


def test_a_download_is_verified_written_once_and_then_read_offline(cv, tmp_path, monkeypatch):
    blob = tar_bytes("0.32.0", FILES)
    index = {"releases": {"0.32.0": [{"packagetype": "bdist_wheel", "url": "x.whl", "digests": {"sha256": "0"}},
                                     {"packagetype": "sdist", "url": "../../packages/vllm-0.32.0.tar.gz",
                                      "digests": {"sha256": hashlib.sha256(blob).hexdigest()}}]}}
    asked = []

    def fake(url, timeout=None):
        asked.append(url)
        if url.endswith("/0.32.0/json"):   # a mirror without per-release pages
            raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)
        return io.BytesIO(json.dumps(index).encode() if url.endswith("/json") else blob)
    monkeypatch.setattr(urllib.request, "urlopen", fake)
    p = cv.fetch_sdist("0.32.0", tmp_path)
    assert p.read_bytes() == blob and asked[-1] == "https://pypi.org/packages/vllm-0.32.0.tar.gz"
    n = len(asked)
    assert cv.fetch_sdist("0.32.0", tmp_path) == p and len(asked) == n   # cached: no network
    index["releases"]["0.32.0"][1]["digests"]["sha256"] = "bad"
    with pytest.raises(ValueError, match="sha256 mismatch"):
        cv.fetch_sdist("0.32.0", tmp_path / "other")
    assert not (tmp_path / "other" / "vllm-0.32.0.tar.gz").exists()
    assert not list((tmp_path / "other").glob("*.part"))


def test_the_script_reads_versions_without_importing_vllm_or_torch(cv):
    import subprocess
    import sys

    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('c', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); V = m.load_versions(); "
            "assert V.TOUCHPOINTS and V.RELEASES; "
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('vllm', 'torch', 'vllm_kunserve')))")
    out = subprocess.run([sys.executable, "-c", code, str(SCRIPT)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
