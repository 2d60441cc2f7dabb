"""Run a Python script in a subprocess on forced CPU devices (XLA_FLAGS must be set before
JAX starts, hence the subprocess), from the repository root with it on the import path."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(args, *, devices: int = 8, xla_flags: str = "", timeout: float = 600):
    """``python *args`` on ``devices`` CPU devices; asserts it exits 0 and returns the
    finished process (stdout and stderr as text)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip(),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc
