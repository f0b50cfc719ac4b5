"""Programmatic dependent launch for kvstore's own Triton kernels (sm_90+).

A kernel launched with Triton's ``launch_pdl`` may be scheduled while the kernel ahead of it on the
stream still runs, so its launch and set-up overlap that kernel's tail. It must then wait for that
grid (:data:`gdc_wait`, ``griddepcontrol.wait``) before its first load or store; the kernels here
take a ``WAIT`` constexpr that puts the wait first. The wait returns at once when the launch was
plain. Whether a kernel is launched so is the caller's choice (``kvstore.engine.launches``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["gdc_wait", "launch_options"]

try:  # grid dependency control: Triton 3.4 and later
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - an older Triton: the kernels launch plainly
    gdc_wait = None


def launch_options(dependent: bool) -> dict[str, Any]:
    """Triton launch options of a kernel launched dependently or not: ``launch_pdl`` only where it is
    asked for (said either way, Triton would key its compile cache on it)."""
    return {"launch_pdl": True} if dependent else {}
