"""``examples/twin.py --quick`` runs and writes what it promises (marker ``examples``: ``pytest -m examples``)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.examples
def test_twin_example_quick(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "twin.py"), "--quick",
                           "--output-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    png = out / "twin_breast_cancer_quick_epsilon.png"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"Wrote {png}" in proc.stdout
    assert (out / "twin_breast_cancer_quick_report_eps1" / "report.json").is_file()
    for pattern in (r"uniform baseline\s+0\.\d{3}\s+0\.\d{3}", r"\n\s+1\s+[0-9.]+\s+30\s+0\.\d{3}",
                    r"\n\s+inf\s+0\s+30\s+0\.\d{3}", r"same columns/dtypes: True"):
        assert re.search(pattern, proc.stdout), (pattern, proc.stdout)
    assert not re.search(r"\bnan\b", proc.stdout, flags=re.I)
