"""Triton kernels on the CPU: a script run under Triton's interpreter (``TRITON_INTERPRET=1``) in a
child process, since the variable is read when triton is imported. Used by the CPU tests of the
engine's Triton kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_interpreted(script: str) -> list[dict[str, Any]]:
    """Run ``script`` under the interpreter; its last line of output is a JSON list of rows."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
