"""Tests of the paper-experiment examples in ``examples/``.

Each example is run with ``--quick`` into a temporary directory in a
subprocess, and the PNGs it promises and the numbers it prints are checked.
These runs take a few minutes together, so they carry the ``examples`` marker:
CI runs them as a separate step (``pytest -m examples``); full runs are never
tests.
The default run only checks, cheaply, that every example offers ``--quick``
and ``--output-dir`` and is documented in ``examples/README.md``.

(``examples/twin.py`` is tested in ``tests/test_twin_example.py``.)
"""

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

# script -> (PNG files it writes, regular expressions its output must match)
CASES = {
    "hierarchical_logistic_regression.py": (
        ["hlr_auc_by_epsilon.png", "hlr_auc_by_n.png"],
        [r"N=\s*500\s+ε=4: σ=[0-9.]+, ε spent=[0-9.]+, AUC 0\.\d{3} ± 0\.\d{3}",
         r"Poisson sampling, add/remove relation",
         r"non-private: σ=0, ε spent=inf, AUC 0\.\d{3}",
         r"baseline", r"Wrote .*hlr_results\.csv"],
    ),
    "gmm.py": (
        ["gmm_test_loglik.png", "gmm_fit.png"],
        [r"ε=1: σ=[0-9.]+, ε spent=[0-9.]+, test log-lik -?\d+\.\d{3}",
         r"Poisson sampling, add/remove relation",
         r"non-private: σ=0, ε spent=inf, test log-lik -?\d+\.\d{3}",
         r"true mixture\s*:\s*-?\d+\.\d{3}", r"Wrote .*gmm_results\.csv"],
    ),
    "vae.py": (
        ["vae_digits_loss.png", "vae_digits_samples.png"],
        [r"ε=[0-9.]+ at δ=1/N=[0-9.e-]+ \(Poisson sampling, add/remove relation",
         r"DP-VI -?\d+\.\d\d, non-private -?\d+\.\d\d",
         r"688884 parameters; per step: DP-VI [0-9.]+ ms, non-private [0-9.]+ ms",
         r"reports ε ≈ 0\.5", r"Wrote .*vae_results\.csv"],
    ),
    "logistic_regression.py": (
        ["logistic_regression.png"],
        [r"calibrated σ=[0-9.]+ for ε=1\.0.*\(Poisson sampling, add/remove relation",
         r"DPSVI:  ε spent=[0-9.]+ \(.*Poisson sampling, add/remove relation\), held-out accuracy 0\.\d{3}",
         r"SVI \(non-private, full batch\): held-out accuracy 0\.\d{3}", r"majority-class baseline: 0\.\d{3}"],
    ),
    "audit.py": (
        ["audit_epsilons.png", "audit_step_scores.png"],
        [r"step, σ=1\.0 +correct +\d+ +0\.\d{4} +[0-9.]+ +[0-9.]+  ok",
         r"DPSVI σ=2 q=0\.5 T=4 +correct .*  ok", r"DPSVI fixed σ=4 q=\.5 T=4 +correct .*  ok",
         r"no_noise .*VIOLATION"],
    ),
    "choosing_parameters.py": (
        ["choosing_parameters.png"],
        # the walkthrough's prose is word-wrapped: a space in it may be a line break
        [r"returns\s+σ\s+=\s+[0-9.]+", r"Step 5", r"clipping_threshold=", r"dp-accounting's\s+PLD",
         r"Poisson sampling, add/remove relation +approximate_sigma_remove_relation",
         r"Poisson sampling, substitute relation +calibrate_sigma",
         r"fixed-size sampling, substitute relation +approximate_sigma "],
    ),
    "resume_with_ledger.py": (
        ["resume_ledger.png"],
        [r"ask for ε=1 at δ=1e-06: calibrated σ=[0-9.]+ for 200 steps",
         r"resumed at step 100: parameters identical to the uninterrupted run, bit for bit",
         r"third analysis refused before its first step", r"total: epsilon = [0-9.]+ at delta = 1e-06",
         r"Wrote .*resume_ledger\.json"],
    ),
}

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# examples that run DPSVI on batches they sample: Poisson sampling (add/remove)
# must be their default, fixed-size batches an explicit ``--sampling fixed``
SAMPLING_OPTION = ["gmm.py", "hierarchical_logistic_regression.py", "logistic_regression.py", "multi_host.py", "twin.py",
                   "vae.py"]


def _read(name):
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_has_cli_and_docs(script):
    source = _read(script)
    ast.parse(source)  # valid Python
    assert '"--quick"' in source and '"--output-dir"' in source
    assert "matplotlib.use(\"Agg\")" in source
    readme = _read("README.md")
    assert f"python examples/{script}" in readme, f"examples/README.md does not show how to run {script}"


@pytest.mark.parametrize("script", SAMPLING_OPTION)
def test_example_defaults_to_poisson_sampling(script):
    source = _read(script)
    assert re.search(r'"--sampling", choices=\("poisson", "fixed"\), default="poisson"', source), script
    assert "sampling=args.sampling" in source or "poisson_batchify_data" in source, script


def test_readme_leaves_the_logistic_regression_section_first():
    readme = _read("README.md")
    headings = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert headings and headings[0].strip() == "Logistic regression"


@pytest.mark.examples
@pytest.mark.parametrize("script", sorted(CASES))
def test_example_quick_run(script, tmp_path):
    pngs, patterns = CASES[script]
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), "--quick", "--output-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for name in pngs:
        path = out / name
        assert path.is_file(), f"{script} did not write {name}; stdout:\n{proc.stdout[-2000:]}"
        with open(path, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE
        assert path.stat().st_size > 5000  # a real plot, not an empty canvas
        assert f"Wrote {path}" in proc.stdout  # says where the output went
    for pattern in patterns:
        assert re.search(pattern, proc.stdout), f"{script}: no match for {pattern!r} in\n{proc.stdout}"
    assert not re.search(r"\bnan\b", proc.stdout, flags=re.I), f"{script} printed nan:\n{proc.stdout}"
