#!/usr/bin/env bash
# The GPU figures of benchmarks/README.md and the default test step on a GPU,
# in one run of at most about nine minutes (each part has its own time limit):
# the step's compile against SVI's (compile.py), per-call and looped step
# ratios, run()'s marginal step, secure normals, then the tests in the time left.
#
# Usage, from the repository root on a machine with a CUDA GPU and JAX for it:
#     OUT=some/folder benchmarks/device_check.sh
# Wheels of packages the machine lacks may be put in .whl/ (installed into a
# private folder first). Output: one log per part under $OUT.
set -u
OUT=${OUT:-benchmarks/output/device}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/d3p-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/d3p-site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
start=$(date +%s)
part() {   # part NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s, at $(( $(date +%s) - start )) s)"
    timeout "$limit" "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" -e "return f(" -e "loss = self" \
        -e "return per_site" | tee "$OUT/$name.txt"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import jax, numpyro, d3p; print('jax', jax.__version__, 'numpyro', numpyro.__version__, jax.devices())"
} 2>&1 | tee "$OUT/versions.txt"
part compile 110 python3 benchmarks/compile.py --rounds 1
part steps 110 python3 benchmarks/dpsvi_vs_svi.py --models vae logreg hlogreg --strategies auto --suites chacha \
    --steps 60 --rounds 3
part steps_loop 70 python3 benchmarks/dpsvi_vs_svi.py --models logreg hlogreg --strategies auto --suites chacha \
    --loop 100 --steps 15 --rounds 3
part run_marginal 70 python3 benchmarks/run_marginal.py --repeats 3
part noise 30 python3 benchmarks/sampling.py --noise --rounds 20
left=$(( 520 - ($(date +%s) - start) ))
if [ "$left" -gt 60 ]; then
    part tests "$left" python3 -m pytest -q -n 8 -o addopts="" \
        -m "not slow and not examples and not manual" --dist loadscope tests
fi
echo "== done at $(( $(date +%s) - start )) s"
