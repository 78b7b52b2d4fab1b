"""Touchpoint: ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``.

On CPU, vLLM moves each unquantized linear weight into a closure (a oneDNN handle holding a packed
copy) and empties ``layer.weight`` (``remove_weight=True``). kunserve needs the weight itself: it
packs it into the memory pool, releases it to the KV cache and streams it through slots. So with
memory features on we call vLLM's dispatch with ``remove_weight=False``: the module keeps its weight
*and* vLLM's fast packed kernel, remembered as ``_kunserve_fast_linear``. Resident layers run that
kernel.

Streamed layers (:class:`PackedSlots`): a oneDNN handle packs its weight once, so it cannot read a
slot whose contents change every step, and ``torch.nn.functional.linear`` on the plain slot weights
is 1.5-2.5x slower at decode sizes. Instead each streamed linear keeps a host copy of its weight in
oneDNN's packed layout, each slot holds one packed oneDNN tensor per linear, and streaming copies the
packed bytes into that slot tensor; the layer computes with ``torch.ops.mkldnn._linear_pointwise``,
which runs the same oneDNN kernel as vLLM's handle (bit-identical outputs, same speed). The slot's
pool region stays reserved at full size, so KV capacity is what it would be on a GPU; on a GPU none
of this runs (the slot weights are read by cuBLAS directly).
"""

from __future__ import annotations

import contextvars
import ctypes
from typing import Any

import torch
from torch import nn

from vllm_kunserve.config import engine_config
from vllm_kunserve.integration.vllm.base import VllmPatch
from vllm_kunserve.integration.vllm.versions import params
from vllm_kunserve.memory.residency import SlotAdapter

#: set while a runner of an engine that moves its weights (remap) loads its model
_KEEP_WEIGHTS: contextvars.ContextVar[bool] = contextvars.ContextVar("kunserve_keep_weights", default=False)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _uses_onednn_handle(fn: Any) -> bool:
    """Whether vLLM's CPU linear closure ``fn`` runs a oneDNN matmul handle (not sgl / zentorch)."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            if type(cell.cell_contents).__name__ == "CPUDNNLGEMMHandler":
                return True
        except ValueError:  # empty cell
            continue
    return False


def packed_kernel_available() -> bool:
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise") and hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes"))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed (opaque ``torch._mkldnn``) tensor of a ``[N, K]`` linear weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _bytes_of(packed: torch.Tensor) -> torch.Tensor:
    """A uint8 CPU tensor aliasing a packed oneDNN tensor's memory (keep ``packed`` alive)."""
    n = int(torch.ops.mkldnn._nbytes(packed))
    buf = (ctypes.c_uint8 * n).from_address(int(torch.ops.mkldnn.data_ptr(packed)))
    return torch.frombuffer(buf, dtype=torch.uint8, count=n)


def _packed_linear(packed: torch.Tensor, n: int, k: int):
    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, k), packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], n)
    return run


def _twin_linears(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """Submodules of ``layer`` whose CPU linear vLLM runs through a oneDNN handle."""
    return [(name, m) for name, m in layer.named_modules()
            if m.__dict__.get("_kunserve_onednn") and getattr(m, "weight", None) is not None]


class PackedSlots(SlotAdapter):
    """CPU: oneDNN-packed host copies and slots for the linears of streamed layers.

    ``prepare(i)`` packs layer ``i``'s linear weights while they are resident (kept across remaps);
    ``copy_plan`` is the :class:`~vllm_kunserve.memory.streaming.WeightStreamer` hook: a streamed
    layer's copy moves its plain tensors (norms, biases) into the pool slot and its packed weights
    into the slot's packed tensors; ``point`` switches a layer's linears between slot and resident.
    """

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = layers
        self.enabled = packed_kernel_available() and any(_twin_linears(layer) for layer in layers)
        self._host: dict[int, dict[str, torch.Tensor]] = {}
        self._slot: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def kind(self) -> str:
        """How streamed linears compute: ``onednn_packed`` (CPU slot tensors) or ``slot_weights``."""
        return "onednn_packed" if self.enabled else "slot_weights"

    def covers(self, i: int) -> bool:
        return self.enabled and bool(_twin_linears(self.layers[i]))

    def prepare(self, i: int) -> int:
        """Pack layer ``i``'s linear weights into host copies (weights must be resident). Bytes packed."""
        if not self.covers(i) or i in self._host:
            return 0
        blobs = {}
        for name, m in _twin_linears(self.layers[i]):
            packed = _pack(m.weight)
            blobs[name] = _bytes_of(packed).clone()
            del packed  # the clone owns the bytes now
        self._host[i] = blobs
        return sum(b.numel() for b in blobs.values())

    def _slot_tensor(self, slot: int, name: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed tensor, uint8 alias)`` of linear ``name`` in ``slot`` (created on first use)."""
        key = (slot, name)
        if key not in self._slot:
            packed = _pack(torch.zeros(like.shape, dtype=like.dtype))
            self._slot[key] = (packed, _bytes_of(packed))
        return self._slot[key]

    def copy_plan(self, entries: list[Any]):
        """The streamer's ``copy_plan`` for layers whose region entries are ``entries[i]``."""
        def plan(i: int, slot: int, slot_tensor: torch.Tensor, host: torch.Tensor):
            if i not in self._host:
                return [(slot_tensor[:host.numel()], host)]
            twins = _twin_linears(self.layers[i])
            ids = {id(m) for _, m in twins}
            skip = [(e.offset, e.offset + e.nbytes) for e in entries[i]
                    if e.attr == "weight" and id(e.owner) in ids]
            pairs = []
            lo = 0
            for a, b in sorted(skip) + [(host.numel(), host.numel())]:
                if a > lo:
                    pairs.append((slot_tensor[lo:a], host[lo:a]))
                lo = max(lo, b)
            for name, m in twins:
                dst = self._slot_tensor(slot, name, m.weight)[1]
                src = self._host[i][name]
                if dst.numel() != src.numel():
                    raise RuntimeError(f"layer {i} {name}: packed size {src.numel()} != slot {dst.numel()}")
                pairs.append((dst, src))
            return pairs
        return plan

    def point(self, i: int, slot: int | None) -> None:
        """Layer ``i``'s linears compute from ``slot`` (streamed) or their resident kernel (None)."""
        packed = i in self._host
        for name, m in self.layers[i].named_modules():
            fast = m.__dict__.get("_kunserve_fast_linear")
            if fast is None:
                continue
            if slot is None:
                m.cpu_linear = fast
            elif packed and m.__dict__.get("_kunserve_onednn"):
                n, k = m.weight.shape
                m.cpu_linear = _packed_linear(self._slot_tensor(slot, name, m.weight)[0], n, k)
            else:
                m.cpu_linear = _linear  # vLLM's own fallback: reads the slot weights at call time

    def drop_slots(self) -> None:
        self._slot.clear()


class CpuLinearPatch(VllmPatch):
    name = "cpu_linear"
    summary = "keep CPU linear weights as plain tensors so kunserve can move them"
    requires = ("moves_memory",)


    def patch(self) -> None:
        utils = self.resolve("vllm.model_executor.layers.utils")
        runner = self.resolve("vllm.v1.worker.cpu_model_runner:CPUModelRunner")

        def make_load(orig):
            def load_model(self, *args, **kwargs):
                kcfg = engine_config(self.vllm_config)
                token = _KEEP_WEIGHTS.set(bool(kcfg is not None and kcfg.moves_memory))
                try:
                    return orig(self, *args, **kwargs)
                finally:
                    _KEEP_WEIGHTS.reset(token)
            return load_model

        def make(orig):
            def dispatch_cpu_unquantized_gemm(layer, remove_weight):
                w = getattr(layer, "weight", None)
                if _KEEP_WEIGHTS.get() and remove_weight and w is not None and not w.is_meta and w.ndim == 2:
                    orig(layer, False)  # keep the weight; vLLM still builds its fast kernel
                    layer._kunserve_fast_linear = layer.cpu_linear
                    layer._kunserve_onednn = _uses_onednn_handle(layer.cpu_linear)
                    return None
                return orig(layer, remove_weight)
            return dispatch_cpu_unquantized_gemm

        self.replace(runner, "load_model", make_load,
                     params=params("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model"))
        self.replace(utils, "dispatch_cpu_unquantized_gemm", make,
                     params=params("vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm"))
