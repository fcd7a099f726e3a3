"""Write the example gallery of the documentation: one page per example script.

Runs every script of ``examples/`` with ``--quick`` (a tiny run that only
shows that everything works; its numbers are not results), and writes, for
each, ``docs/gallery/<script>.md`` with the script's docstring, the command,
what it printed and the figures it wrote, then ``docs/gallery/index.md`` with
a thumbnail per example. The figures are copied to ``docs/gallery/_images/``.
The pages and figures are committed, so the documentation builds without
running the examples; run this again after changing an example::

    python docs/gallery.py                        # every example (minutes of CPU time)
    python docs/gallery.py logistic_regression.py # only that one, index kept up to date
    python docs/gallery.py --no-run               # the pages again from what they record

Only the standard output is recorded (progress bars and warnings go to
standard error); the temporary output folder in it reads ``examples/output``,
where the command shown writes by default.
"""

import argparse
import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GALLERY = ROOT / "docs" / "gallery"
IMAGES = "_images"

# Figures larger than this are re-encoded with a palette, then shrunk.
MAX_FIGURE_BYTES = 150_000
THUMBNAIL_WIDTH = 360


def example_scripts():
    """The example scripts, in the order ``examples/README.md`` shows them."""
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")

    def position(name):
        at = readme.find(f"python examples/{name}")
        return (at < 0, at, name)

    return sorted(scripts, key=position)


def command(script):
    """The command a page records: what the reader runs from the repository root."""
    return f"python examples/{script} --quick"


def describe(script):
    """The script's docstring as (title, body): its first line and the rest."""
    doc = ast.get_docstring(ast.parse((EXAMPLES / script).read_text(encoding="utf-8"))) or script
    title, _, body = doc.partition("\n")
    return title.strip().rstrip("."), body.strip("\n")


def run_quick(script, output_dir):
    """Run ``script --quick`` into ``output_dir``; returns its standard output,
    with the output folder written as ``examples/output`` and this checkout's
    root as a relative path."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["MPLBACKEND"] = "Agg"
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--quick", "--output-dir", str(output_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{command(script)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    out = proc.stdout.replace(str(output_dir), "examples/output")
    return out.replace(str(ROOT) + os.sep, "").replace(str(ROOT), ".")


def _save_png(image, path):
    image.save(path, format="PNG", optimize=True)
    return path.stat().st_size


def copy_figure(source, target):
    """Copy a PNG, re-encoded with a 256-colour palette (and shrunk, if need
    be) when it is larger than ``MAX_FIGURE_BYTES``; returns its size."""
    from PIL import Image

    shutil.copyfile(source, target)
    if target.stat().st_size <= MAX_FIGURE_BYTES:
        return target.stat().st_size
    image = Image.open(source).convert("RGB")
    while True:
        size = _save_png(image.quantize(colors=256, method=Image.Quantize.MEDIANCUT), target)
        if size <= MAX_FIGURE_BYTES:
            return size
        image = image.resize((image.width * 4 // 5, image.height * 4 // 5), Image.Resampling.LANCZOS)


def write_thumbnail(source, target):
    """A small copy of a figure for the gallery's index."""
    from PIL import Image

    image = Image.open(source).convert("RGB")
    height = round(image.height * THUMBNAIL_WIDTH / image.width)
    image = image.resize((THUMBNAIL_WIDTH, height), Image.Resampling.LANCZOS)
    _save_png(image.quantize(colors=256, method=Image.Quantize.MEDIANCUT), target)


def stem(script):
    return script[:-len(".py")]


def fence(text):
    """A code fence longer than any run of backticks in ``text``."""
    return "`" * max([3] + [len(run) + 1 for run in re.findall(r"`{3,}", text)])


def page(script, title, body, output, figures, seconds):
    """The Markdown of an example's page."""
    output = output.rstrip("\n")
    lines = [f"# {title}", "", f"`examples/{script}`", "", fence(body) + "{eval-rst}", body, fence(body), "",
             "## Run it", "",
             "The printed output and the figures on this page are from a quick run, a tiny",
             "run that only shows that everything works (its numbers are not results),",
             "made from the repository root with", "",
             "```sh", command(script), "```", "",
             f"({seconds:.0f} s wall-clock when this page was made). Without",
             "`--quick` the script runs the full experiment that `examples/README.md`",
             "describes and measures. Its outputs go to `examples/output/`",
             "(`--output-dir` chooses another folder).", "",
             "## Output", "", fence(output) + "text", output, fence(output), ""]
    if figures:
        lines += ["## Figures", ""]
        for name in figures:
            written_as = name.split("__", 1)[1]
            lines += [f"```{{figure}} {IMAGES}/{name}", f":alt: {written_as}, written by examples/{script} --quick",
                      "", f"`{written_as}`", "```", ""]
    lines += ["## Source", "", f"```{{literalinclude}} ../../examples/{script}", ":language: python", "```", ""]
    return "\n".join(lines)


def index(scripts, gallery=GALLERY):
    """The Markdown of the gallery's index: a card per example."""
    lines = ["# Gallery", "",
             "Every script in `examples/`, with what it prints and the figures it writes",
             "in a quick run (`--quick`: a tiny run that only shows that everything works;",
             "its numbers are not results). [Examples](../examples.md) describes the full",
             "experiments and the numbers they measured.", "",
             "```{toctree}", ":hidden:", "", *[stem(s) for s in scripts], "```", "",
             "````{container} gallery-grid", ""]
    for script in scripts:
        title, _ = describe(script)
        thumb = gallery / IMAGES / f"thumb_{stem(script)}.png"
        lines += ["```{container} gallery-card", ""]
        if thumb.is_file():
            lines += [f"[![{stem(script)}]({IMAGES}/{thumb.name})]({stem(script)}.md)", ""]
        lines += [f"[{title}]({stem(script)}.md)", "", "```", ""]
    lines += ["````", ""]
    return "\n".join(lines)


def run_example(script, gallery):
    """Run ``script --quick``, copy its figures into ``gallery`` and write its
    thumbnail; returns (printed output, figure names, seconds)."""
    images = gallery / IMAGES
    images.mkdir(parents=True, exist_ok=True)
    for old in images.glob(f"{stem(script)}__*.png"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        output_dir = pathlib.Path(tmp) / "output"
        start = time.perf_counter()
        output = run_quick(script, output_dir)
        seconds = time.perf_counter() - start
        figures = []
        for png in sorted(output_dir.glob("*.png")):  # not those of reports in subfolders
            name = f"{stem(script)}__{png.name}"
            size = copy_figure(png, images / name)
            figures.append(name)
            print(f"Wrote {os.path.relpath(images / name)} ({size // 1000} kB)")
        thumb = images / f"thumb_{stem(script)}.png"
        if figures:
            write_thumbnail(output_dir / figures[0].split("__", 1)[1], thumb)
        elif thumb.exists():
            thumb.unlink()
    return output, figures, seconds


def recorded(path):
    """What an existing page records: (printed output, figure names, seconds)."""
    text = path.read_text(encoding="utf-8")
    output = re.search(r"^## Output\n\n(`{3,})text\n(.*?)\n\1$", text, flags=re.M | re.S).group(2)
    figures = [name[len(IMAGES) + 1:] for name in re.findall(r"^```\{figure\} (\S+)", text, flags=re.M)]
    seconds = float(re.search(r"(\d+) s wall-clock", text).group(1))
    return output, figures, seconds


def build(scripts, gallery=GALLERY, run=True):
    """Write the pages of ``scripts`` into ``gallery``, running them (or, with
    ``run=False``, from what their existing pages record); returns the pages."""
    written = []
    for script in scripts:
        title, body = describe(script)
        path = gallery / f"{stem(script)}.md"
        output, figures, seconds = run_example(script, gallery) if run else recorded(path)
        path.write_text(page(script, title, body, output, figures, seconds), encoding="utf-8")
        print(f"Wrote {os.path.relpath(path)}")
        written.append(path)
    return written


def main(argv=None):
    all_scripts = example_scripts()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scripts", nargs="*", metavar="SCRIPT",
                        help=f"examples to run (default: all of {', '.join(all_scripts)})")
    parser.add_argument("--gallery-dir", type=pathlib.Path, default=GALLERY,
                        help="where the pages go (default: docs/gallery/)")
    parser.add_argument("--no-run", action="store_true",
                        help="rewrite the pages from the output and figures they record, without running "
                             "the examples (after a change to the page layout or to a docstring)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.scripts) - set(all_scripts))
    if unknown:
        parser.error(f"unknown example(s) {unknown}; expected some of {all_scripts}")
    build(args.scripts or all_scripts, args.gallery_dir, run=not args.no_run)
    path = args.gallery_dir / "index.md"
    path.write_text(index(all_scripts, args.gallery_dir), encoding="utf-8")
    print(f"Wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
