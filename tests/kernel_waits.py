"""Where inductor's generated kernels wait for the grid before them (programmatic dependent launch).

A kernel launched dependently may start while the kernel ahead of it still runs; it must wait
(``gdc_wait``) before it loads or stores anything. Used by the engine's GPU test on the compiled
regions' generated code, and by a CPU test on planted sources.
"""

from __future__ import annotations

import re

_KERNEL = re.compile(r"async_compile\.triton\(\s*'(\w+)',\s*'''(.*?)'''", re.DOTALL)
_ACCESS = re.compile(r"\btl\.(load|store|atomic_\w+)\(")
_WAIT = "tl.extra.cuda.gdc_wait()"


def dependent_kernels(source: str) -> dict[str, str]:
    """The kernels in an inductor output module that launch dependently: {name: kernel text}."""
    return {name: text for name, text in _KERNEL.findall(source) if "'launch_pdl': True" in text}


def accesses_before_the_wait(text: str) -> str | None:
    """The first load or store a dependent kernel issues before its wait (its line), or None when
    it waits first."""
    body = text[text.index("@triton.jit") :]
    access = _ACCESS.search(body)
    if access is None:
        return None
    wait = body.find(_WAIT)
    if wait != -1 and wait < access.start():
        return None
    return body[body.rfind("\n", 0, access.start()) + 1 : body.find("\n", access.start())].strip()
