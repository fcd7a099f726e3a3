"""Where a step's CPU compile time goes: XLA's kernels, by the code that made them.

XLA:CPU spends most of a program's compile time generating code for its
kernels (LLVM for each fusion, one at a time or a few in parallel), and it
logs each kernel's time at a raised verbosity (``TF_CPP_VMODULE``). This
script compiles the jitted ``update`` of NumPyro's SVI and of DPSVI for one
model of ``benchmarks/dpsvi_vs_svi.py`` (the settings of
``benchmarks/compile.py``) in a child process with that logging on, on one
core (``taskset``, the last core, where available, so that the times add up to the
compile's), (the second compile of the step in that process: the first carries
one-off costs), and attributes every kernel's seconds to the innermost d3p
function (else the library file) on the call stack of the instruction that
names the kernel, from the stack frames the compiled program's text carries.

Usage::

    python benchmarks/compile_kernels.py [--model vae] [--top 15]

Prints, for SVI and DPSVI, the compile's seconds, the kernels' sum and the
``--top`` sources by seconds. The logging slows the compile (SVI's VAE
step: 2.2 s here against 1.4 s without it, one core): read the shares, and
take ratios from ``benchmarks/compile.py``.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, warnings
sys.path.insert(0, {bench!r})
import jax, numpy as np, numpyro
from numpyro.infer import SVI, Trace_ELBO
from dpsvi_vs_svi import make_problem
import d3p.random
from d3p.svi import DPSVI
model, guide, batch, shared, B, N, lr = make_problem({model!r}, np.random.default_rng(0))
warnings.simplefilter("ignore")
if {who!r} == "svi":
    svi = SVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), **shared)
    state = svi.init(jax.random.PRNGKey(0), *batch)
else:
    svi = DPSVI(model, guide, numpyro.optim.Adam(lr), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0, **shared)
    state = svi.init(d3p.random.PRNGKey(0), *batch)
def lower():
    return jax.jit(lambda s, *b: svi.update(s, *b)).trace(state, *batch).lower()
lower().compile()   # the process's first compile carries one-off costs: not measured
lowered = lower()
print("MARK-START", file=sys.stderr, flush=True)
compiled = lowered.compile()
print("MARK-END", file=sys.stderr, flush=True)
open({hlo!r}, "w").write(compiled.as_text())
"""

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _seconds(text: str) -> float:
    value, unit = re.match(r"([\d.]+) (\w+)", text).groups()
    return float(value) * _UNITS[unit]


def _kernel_times(log: str) -> tuple:
    """``({kernel: seconds}, compile seconds)`` of the compile between the marks."""
    part = log[log.index("MARK-START"):log.index("MARK-END")]
    times = collections.Counter()
    for m in re.finditer(r"Compiled (?:LLVM|MLIR) module: (\S+) time: ([\d.]+ \w+)", part):
        name = m.group(1).replace("__compute_module_", "").replace("_kernel_module", "").replace("wrapped_", "")
        times[name] += _seconds(m.group(2))
    total = [_seconds(t) for t in re.findall(r"Compiling \[\S+\] for CPU using JIT time: ([\d.]+ \w+)", part)]
    return times, (total[-1] if total else float("nan"))


def _sources(hlo: str) -> dict:
    """Instruction name -> the innermost d3p function (else library file) on its stack."""
    sections, sec = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}, None
    for line in hlo.splitlines():
        if line in sections:
            sec = line
            continue
        if sec and not line.strip():
            sec = None
        elif sec in ("FileNames", "FunctionNames"):
            i, name = line.split(" ", 1)
            sections[sec][int(i)] = name.strip('"')
        elif sec:
            fields = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", line))
            sections[sec][int(line.split(" ", 1)[0])] = fields

    def frame_names(fid):
        out, seen = [], set()
        while fid and fid in sections["StackFrames"] and fid not in seen:
            seen.add(fid)
            frame = sections["StackFrames"][fid]
            loc = sections["FileLocations"][frame["file_location_id"]]
            path = sections["FileNames"][loc["file_name_id"]]
            short = path.split("site-packages/")[-1]
            short = short[short.rindex("d3p/"):] if "/d3p/" in path and "site-packages" not in path else short
            out.append((short, sections["FunctionNames"].get(loc["function_name_id"], "?")))
            fid = frame.get("parent_frame_id")
        return out

    names = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
        if not m or m.group(1) in names:
            continue
        f = re.search(r"stack_frame_id=(\d+)", line)
        frames = frame_names(int(f.group(1))) if f else []
        ours = [f"{p}:{fn}" for p, fn in frames if p.startswith("d3p/")]
        names[m.group(1)] = ours[0] if ours else (frames[0][0] if frames else "<no stack>")
    return names


def measure(model: str, who: str) -> tuple:
    bench = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        hlo_path = os.path.join(tmp, "compiled.txt")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="ir_compiler=1,cpu_compiler=2,fusion_compiler=2")
        cmd = [sys.executable, "-c", CHILD.format(bench=bench, model=model, who=who, hlo=hlo_path)]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", str(os.cpu_count() - 1)] + cmd
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        times, total = _kernel_times(proc.stderr)
        names = _sources(open(hlo_path).read())
    by_source = collections.Counter()
    for kernel, seconds in times.items():
        by_source[names.get(kernel, names.get(kernel.rsplit(".", 1)[0], "<other>"))] += seconds
    return total, sum(times.values()), by_source


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="vae", choices=["vae", "logreg", "hlogreg"])
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for who in ("svi", "dpsvi"):
        total, kernels, by_source = measure(args.model, who)
        print(f"## {who} ({args.model}): compile {total:.2f} s, kernels {kernels:.2f} s")
        for source, seconds in by_source.most_common(args.top):
            print(f"{seconds:7.3f}  {source}")


if __name__ == "__main__":
    main()
