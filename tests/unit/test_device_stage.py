"""scripts/device_stage.py: slimming, pack/rebuild round trip, part sizes, calls."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "device_stage", ROOT / "scripts" / "device_stage.py"
)
ds = importlib.util.module_from_spec(_spec)
sys.modules["device_stage"] = ds
_spec.loader.exec_module(ds)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{name},sha256={digest.decode()},{len(data)}\n"


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A tiny real wheel (deflated, with a valid RECORD)."""
    di = f"{name}-{version}.dist-info"
    members = dict(files)
    members[f"{di}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    )
    members[f"{di}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(_record_line(n, d) for n, d in members.items())
    record += f"{di}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in members.items():
            z.writestr(n, d)
        z.writestr(f"{di}/RECORD", record)
    return path


def pip_target_install(wheel: Path, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--no-compile", "--disable-pip-version-check", "--target", str(target),
         "--python-version", "3.12", "--implementation", "cp",
         "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", str(wheel)],
        capture_output=True, text=True,
    )


def test_slim_drops_members_and_rewrites_record(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    big = bytes(range(256)) * 400
    wheel = make_wheel(src, "vllm", "0.26.0", {
        "vllm/__init__.py": b"x = 1\n",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": big,
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
        "vllm/_moe_C_stable_libtorch.abi3.so": b"moe",
        "vllm/_C_stable_libtorch.abi3.so": b"core",
        "vllm/vllm-rs": b"rust",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so": b"311",
        "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so": b"312",
    })
    out = tmp_path / wheel.name
    dropped = ds.restore_wheel(wheel, out, ds.slim_rules("3.12"))
    gone = {d["member"] for d in dropped}
    assert gone == {
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/vllm-rs",
        "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
    }
    assert all(d["reason"] for d in dropped)
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        record = z.read("vllm-0.26.0.dist-info/RECORD").decode()
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    assert not gone & set(names)
    assert "vllm/_C_stable_libtorch.abi3.so" in names
    assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in names
    assert "deep_gemm/_C.cpython-312" in record
    for member in gone:
        assert member not in record
    # deterministic: the same input gives the same bytes
    again = tmp_path / "again.whl"
    ds.restore_wheel(wheel, again, ds.slim_rules("3.12"))
    assert ds.sha256_file(again) == ds.sha256_file(out)
    # pip, which checks RECORD, accepts the slimmed wheel
    target = tmp_path / "site"
    r = pip_target_install(out, target)
    assert r.returncode == 0, r.stderr
    assert (target / "vllm" / "_C_stable_libtorch.abi3.so").read_bytes() == b"core"
    assert not (target / "vllm" / "vllm-rs").exists()


def test_slim_keeps_the_target_pythons_deep_gemm():
    rules = ds.slim_rules("3.11")
    name = "vllm/third_party/deep_gemm/_C.cpython-{}-x86_64-linux-gnu.so"
    hit = [any(rx.match(name.format(t)) for rx, _ in rules) for t in (310, 311, 312)]
    assert hit == [True, False, True]


def _stage(tmp_path: Path, part_size: int) -> tuple[Path, list[Path]]:
    src = tmp_path / "wheels"
    src.mkdir()
    import random

    rnd = random.Random(7)
    wheels = [
        make_wheel(src, "alpha", "1.0", {"alpha/__init__.py": b"a" * 5000}),
        make_wheel(src, "beta", "2.0",
                   {"beta/blob.bin": bytes(rnd.getrandbits(8) for _ in range(30000))}),
    ]
    stage = tmp_path / "stage"
    stage.mkdir()
    parts, info = ds.pack(wheels, stage, part_size)
    (stage / ds.MANIFEST).write_text(json.dumps({"parts": parts, "wheels": info}))
    return stage, wheels


def test_pack_rebuild_round_trip(tmp_path):
    stage, wheels = _stage(tmp_path, part_size=7000)
    parts = sorted(stage.glob("part*"))
    assert len(parts) >= 3
    assert all(p.stat().st_size <= 7000 for p in parts)
    out = ds.rebuild(stage, tmp_path / "out")
    assert sorted(p.name for p in out) == sorted(w.name for w in wheels)
    for w in wheels:
        assert (tmp_path / "out" / w.name).read_bytes() == w.read_bytes()


def test_corrupt_or_missing_part_is_refused(tmp_path, capsys):
    stage, _ = _stage(tmp_path, part_size=7000)
    part = stage / "part02"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit):
        ds.rebuild(stage, tmp_path / "out")
    assert "part02 is corrupt" in capsys.readouterr().err
    part.unlink()
    with pytest.raises(SystemExit):
        ds.main(["check", "2", "--stage", str(stage)])
    assert "part02 is missing" in capsys.readouterr().err


def test_check_verifies_one_part(tmp_path, capsys):
    stage, _ = _stage(tmp_path, part_size=7000)
    ds.main(["check", "1", "--stage", str(stage)])
    assert "part 1/" in capsys.readouterr().out


@pytest.mark.parametrize("tree", [0, 7_500_000, 40 * ds.MiB, 58 * ds.MiB])
def test_part_budget_never_exceeds_the_call_limit(tree):
    budget = ds.part_budget(tree)
    assert tree + budget + ds.MANIFEST_RESERVE + ds.MARGIN <= ds.CALL_LIMIT
    assert budget >= ds.MiB


def test_part_budget_refuses_a_tree_that_leaves_no_room():
    with pytest.raises(ValueError):
        ds.part_budget(62 * ds.MiB)


def test_tree_bytes_counts_the_checkout():
    n = ds.tree_bytes()
    assert n >= (ROOT / "scripts" / "device_stage.py").stat().st_size
    assert n < ds.CALL_LIMIT


def test_calls_fit_the_tool_limits():
    parts = [{"name": f"part{k:02d}", "bytes": 1, "sha256": "0" * 64}
             for k in range(1, 4)]
    then = "pytest -q -m gpu tests/gpu " + "x" * 1500
    seq = ds.calls({"parts": parts}, then)
    assert len(seq) == 3
    for k, c in enumerate(seq, 1):
        assert len(c["command"]) <= ds.CMD_LIMIT
        assert len(c["carry"]) <= ds.CARRY_LIMIT
        assert c["carry"][0] == f".whl/part{k:02d}"
        assert ".whl/manifest.json" in c["carry"]
        assert c["command"].startswith(f"python3 scripts/device_stage.py check {k}")
    assert "install --target /tmp/site" in seq[-1]["command"]
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" in seq[-1]["command"]
    assert "PYTHONPATH=/tmp/site:$PWD" in seq[-1]["command"]
    assert seq[-1]["command"].endswith(then)
    assert "install" not in seq[0]["command"]
    with pytest.raises(ValueError):
        ds.calls({"parts": parts}, "x" * ds.CMD_LIMIT)
    extra = [f"e{i}" for i in range(ds.CARRY_LIMIT)]
    with pytest.raises(ValueError):
        ds.calls({"parts": parts}, "", extra=extra)
    seq = ds.calls({"parts": parts}, "", stage=".whl/py311", extra=["x"])
    assert seq[-1]["carry"] == [".whl/py311/part03", ".whl/py311/manifest.json", "x"]
    assert "install --stage .whl/py311" in seq[-1]["command"]
    # the plugin itself is installed from the tree, so that vLLM finds its entry points
    assert "--no-build-isolation --no-index --no-compile --upgrade --target /tmp/site ." in seq[-1]["command"]


def test_printed_sequence_of_the_real_manifest_fits(capsys):
    stage = ROOT / ".whl"
    if not (stage / ds.MANIFEST).is_file():
        pytest.skip("no plan made in this checkout")
    ds.main(["calls", "--then", "pytest -q -m gpu tests/gpu"])
    out = capsys.readouterr().out
    assert "call 1: carry=" in out


def test_pins_do_not_shadow_device_packages():
    assert not {ds.canon(n) for n in ds.PINS} & set(ds.DEVICE_PACKAGES)
