"""Running a script in float64: x64 can only be switched on for a whole process."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_x64(script: str) -> list[str]:
    """Run `script` (formatted with {tests}: this directory, for imports) in a Python process
    with x64 on and fp32-exact matmuls; returns the words after its `RESULT` line."""
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_DEFAULT_MATMUL_PRECISION="highest")
    out = subprocess.run([sys.executable, "-c", script.format(tests=TESTS)], env=env,
                         capture_output=True, text=True, timeout=1200)
    line = [s for s in out.stdout.splitlines() if s.startswith("RESULT")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return line[0].split()[1:]
