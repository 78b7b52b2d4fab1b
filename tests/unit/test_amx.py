"""runtime/amx.py: the plugin asks for the AMX tile state where the CPU has it, unless told not to."""

import pytest

from vllm_kunserve.runtime import amx

pytestmark = pytest.mark.unit

SPR = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu avx2 fma\nbugs\t\t: amx_tile\n"   # only the flags line counts


def test_amx_is_read_from_the_flags_line_only():
    assert amx.has_amx(SPR) and not amx.has_amx(ZEN3) and not amx.has_amx("")


def test_on_unless_switched_off_and_a_bad_value_is_refused():
    assert amx.wanted({}) and amx.wanted({amx.ENV: "1"}) and amx.wanted({amx.ENV: " on "})
    assert not amx.wanted({amx.ENV: "0"}) and not amx.wanted({amx.ENV: "off"})
    with pytest.raises(ValueError, match="KUNSERVE_AMX_INIT must be 1 or 0"):
        amx.wanted({amx.ENV: "maybe"})


def test_asked_once_per_process_and_not_where_switched_off(monkeypatch):
    calls = []
    monkeypatch.setattr(amx, "request_tile_state", lambda: calls.append(1))
    monkeypatch.setattr(amx, "has_amx", lambda cpuinfo=None: True)
    monkeypatch.setattr(amx, "_done", {})
    monkeypatch.setenv(amx.ENV, "0")
    assert amx.init_amx_if_present() is False and calls == []
    monkeypatch.setattr(amx, "_done", {})
    monkeypatch.delenv(amx.ENV)
    assert amx.init_amx_if_present() is True and amx.init_amx_if_present() is True and calls == [1]
    monkeypatch.setattr(amx, "_done", {})
    monkeypatch.setattr(amx, "has_amx", lambda cpuinfo=None: False)
    assert amx.init_amx_if_present() is False and calls == [1]   # no AMX: nothing asked


def test_a_refusal_is_logged_and_the_process_goes_on(monkeypatch, caplog):
    def refuse():
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(amx, "request_tile_state", refuse)
    monkeypatch.setattr(amx, "has_amx", lambda cpuinfo=None: True)
    monkeypatch.setattr(amx, "_done", {})
    monkeypatch.delenv(amx.ENV, raising=False)
    assert amx.init_amx_if_present() is False
    assert "AMX tile state not granted" in caplog.text


@pytest.mark.skipif(not amx.has_amx(), reason="no AMX on this CPU: the kernel would refuse the tile state")
def test_the_kernel_grants_the_tile_state_here():
    amx.request_tile_state()   # raises OSError if refused
