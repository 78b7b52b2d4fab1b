"""Version-gated, idempotent patch classes: the only way kunserve touches vLLM.

Each touchpoint is one small :class:`VllmPatch` subclass; the vLLM releases it supports, and the
parameters it checks on what it replaces, come from ``versions.py`` (the one version policy). Plugins load in every process vLLM starts (API server, engine core, workers,
the model-registry subprocess), often more than once, so ``apply`` must be idempotent: a patched
attribute is tagged and never wrapped twice. ``revert`` restores the originals (used by tests).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Callable, ClassVar

from vllm_kunserve.integration.vllm import versions as policy
from vllm_kunserve.integration.vllm.versions import vllm_version

logger = logging.getLogger("vllm.kunserve")

_TAG = "__kunserve_patch__"


class PatchShapeError(RuntimeError):
    """A vLLM symbol kunserve replaces no longer has the shape the touchpoint was written for."""


class VllmPatch:
    """One vLLM touchpoint. Subclasses set ``name``, ``versions``, ``target`` and implement ``patch``."""

    name: ClassVar[str] = ""
    #: vLLM versions this touchpoint supports: the one range of ``versions.py`` (where each touchpoint
    #: was verified, and how, is recorded there too).
    versions: ClassVar[str] = policy.SUPPORTED
    #: human summary for the patches/ record and the startup log.
    summary: ClassVar[str] = ""
    #: config sections that must be enabled for this touchpoint to be applied (empty: always)
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    # -- helpers for subclasses -------------------------------------------------------------
    @staticmethod
    def resolve(dotted: str) -> Any:
        """Import ``pkg.mod:Attr.sub`` and return the object."""
        mod_name, _, attr_path = dotted.partition(":")
        obj: Any = importlib.import_module(mod_name)
        for part in filter(None, attr_path.split(".")):
            obj = getattr(obj, part)
        return obj

    def replace(self, owner: Any, attr: str, make: Callable[[Any], Any], params: tuple[str, ...] | None = None
                ) -> bool:
        """Replace ``owner.attr`` by ``make(original)`` unless already done. Returns True if replaced.

        ``params``: the parameter names the original must start with (checked first: a vLLM release
        that changed the symbol refuses to start with :class:`PatchShapeError` naming it)."""
        current = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if current is None:
            current = getattr(owner, attr, None)
        where = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{attr}"
        if current is None:
            raise PatchShapeError(f"kunserve patch {self.name}: vLLM {vllm_version()} has no {where}")
        if getattr(current, _TAG, None) == self.name:
            return False
        if params is not None:
            self.check_params(current, params, where)
        new = make(current)
        try:
            setattr(new, _TAG, self.name)
        except (AttributeError, TypeError):  # e.g. staticmethod objects on old Pythons
            pass
        setattr(owner, attr, new)
        self._saved.append((owner, attr, current))
        return True

    def check_params(self, fn: Any, params: tuple[str, ...], where: str) -> None:
        """Refuse to start (:class:`PatchShapeError`) unless ``fn``'s parameters start with ``params``."""
        try:
            got = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            got = ()
        if got[:len(params)] != params:
            raise PatchShapeError(
                f"kunserve patch {self.name}: {where} has parameters {got}, expected {params} "
                f"(verified on vllm{self.versions}); refusing to start")

    # -- lifecycle ---------------------------------------------------------------------------
    def supported(self, version: str | None = None) -> bool:
        return policy.in_range(version or vllm_version(), self.versions)

    def wanted(self, cfg: Any) -> bool:
        """Whether this touchpoint is needed for the configured features (see ``requires``)."""
        def on(section: str) -> bool:
            v = getattr(cfg, section)
            return v if isinstance(v, bool) else v.enable
        return any(on(section) for section in self.requires) if self.requires else True

    def patch(self) -> None:
        """Process-wide changes (monkeypatches), inert for engines without kunserve. Idempotent."""

    def configure(self, cfg: Any, holder: Any) -> None:
        """Per-engine changes to ``holder`` (an ``EngineArgs`` or a ``VllmConfig``). Default: none."""

    def revert(self) -> None:
        while self._saved:
            owner, attr, original = self._saved.pop()
            setattr(owner, attr, original)


def is_patched(obj: Any) -> str | None:
    """Name of the kunserve patch that replaced ``obj``, or None."""
    return getattr(obj, _TAG, None)
