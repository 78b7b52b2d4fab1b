"""The touchpoints applied in this process (filled by ``integration.vllm.apply_named``, in
application order). Its own module so that touchpoints can report it without importing the
package that lists them."""

from __future__ import annotations

from typing import Any

#: patch name -> applied VllmPatch instance, in application order
APPLIED: dict[str, Any] = {}


def applied() -> list[str]:
    return list(APPLIED)
