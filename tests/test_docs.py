"""The documentation builds without warnings, documents every public name on
its module's page, fits a phone's screen, shows every example in the gallery,
and its docstring examples run as doctests."""

import doctest
import html as html_module
import html.parser
import importlib
import inspect
import io
import pathlib
import re
import subprocess
import sys
import zlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Modules whose ``__all__`` is public API; each has a page docs/api/<module>.rst
# that documents every name in it.
PUBLIC_MODULES = [
    "d3p",
    "d3p.__main__",
    "d3p.svi",
    "d3p.minibatch",
    "d3p.gradients",
    "d3p.discrete",
    "d3p.accounting",
    "d3p.ledger",
    "d3p.selection",
    "d3p.dputil",
    "d3p.random",
    "d3p.random.debug",
    "d3p.modelling",
    "d3p.util",
    "d3p.audit",
    "d3p.gmm",
    "d3p.optimizers",
    "d3p.twin",
]


def _module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Every module of the package with a docstring example, found without importing.
DOCTEST_MODULES = sorted(
    _module_name(path)
    for path in (ROOT / "d3p").rglob("*.py")
    if ">>>" in path.read_text(encoding="utf-8")
)


@pytest.fixture(scope="module")
def html_build(tmp_path_factory):
    """Build the HTML site once, as CI does: warnings are errors."""
    out = tmp_path_factory.mktemp("docs")
    command = [
        sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
        "-d", str(out / "doctrees"), str(DOCS), str(out / "html"),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    return proc, out / "html"


def _inventory(path):
    """The objects of a Sphinx ``objects.inv`` (format version 2): name -> page."""
    data = path.read_bytes()
    for _ in range(4):  # four plain-text header lines, then zlib
        data = data[data.index(b"\n") + 1:]
    lines = zlib.decompress(data).decode().splitlines()
    # "name domain:role priority uri display-name"; the name may contain spaces
    pattern = re.compile(r"(.+?)\s+\S+:\S+\s+-?\d+\s+(\S*)")
    entries = {}
    for line in lines:
        match = pattern.match(line)
        if match:
            name, uri = match.groups()
            entries.setdefault(name, uri.split("#", 1)[0])
    return entries


@pytest.mark.slow
def test_docs_build_without_warnings(html_build):
    proc, html = html_build
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout}\n{proc.stderr}"
    pages = ["index", "api", "privacy", "auditing", "twin", "examples", "benchmarks", "gallery/index"]
    pages += [f"api/{module_name}" for module_name in PUBLIC_MODULES]
    pages += [f"gallery/{script[:-3]}" for script in EXAMPLE_SCRIPTS]
    for page in pages:
        assert (html / f"{page}.html").is_file(), page


@pytest.mark.slow
def test_api_reference_covers_every_public_name(html_build):
    _, html = html_build
    documented = _inventory(html / "objects.inv")
    missing = []
    for module_name in PUBLIC_MODULES:
        assert module_name in documented, f"module {module_name} is not in the API reference"
        assert documented[module_name] == f"api/{module_name}.html", (
            f"module {module_name} is documented on {documented[module_name]}, not on its own page")
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            candidates = {f"{module_name}.{name}"}
            if inspect.ismodule(obj):
                candidates.add(obj.__name__)
            elif getattr(obj, "__module__", None) and hasattr(obj, "__qualname__"):
                candidates.add(f"{obj.__module__}.{obj.__qualname__}")  # re-exported
            if not candidates & documented.keys():
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public names missing from the API reference (docs/api/): {missing}"


def _built_pages(html):
    return sorted(path for path in html.rglob("*.html"))


@pytest.mark.slow
def test_html_shows_no_build_machine_paths(html_build):
    """Signatures show defaults as written (``rng_suite=d3p.random``), not a
    module's repr with the file it was loaded from."""
    _, html = html_build
    patterns = [re.escape(str(ROOT)), r"<module ['\"]", r"from ['\"]/"]
    found = []
    for path in _built_pages(html):
        text = path.read_text(encoding="utf-8")
        shown = html_module.unescape(re.sub(r"<[^>]*>", "", text))  # what the reader sees
        found += [f"{path.relative_to(html)}: {m.group(0)!r}"
                  for p in patterns for page in (text, shown) for m in re.finditer(p, page)]
    assert not found, f"built pages show paths of the build machine: {found}"
    svi = (html / "api" / "d3p.svi.html").read_text(encoding="utf-8")
    assert re.search(r"rng_suite</span>.{0,200}d3p\.random<", svi, flags=re.S), "no rng_suite=d3p.random"


@pytest.mark.slow
def test_theme_is_furo_and_pages_scale_to_the_screen(html_build):
    _, html = html_build
    for name in ["index", "api", "api/d3p.svi", "gallery/index"]:
        text = (html / f"{name}.html").read_text(encoding="utf-8")
        assert re.search(r'<meta name="viewport" content="width=device-width,\s*initial-scale=1', text), name
        assert "_static/styles/furo.css" in text, f"{name} is not styled by furo"
        assert "_static/d3p.css" in text, f"{name} does not load d3p.css"


class _LayoutParser(html.parser.HTMLParser):
    """What in a page's main text could make it wider than a phone's screen:
    inline code, tables and display maths outside furo's scrolling wrappers,
    and images of a fixed width."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack = []  # (tag, classes) of the open elements
        self.code = None  # [depth, text] of the inline code being read
        self.inline_code = []
        self.unwrapped = []  # tables and display maths outside a scroll container
        self.fixed_width_images = []

    def _inside(self, cls):
        return any(cls in classes for _, classes in self.stack)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = set((attrs.get("class") or "").split())
        if tag == "img":
            widths = [attrs.get("width") or ""] + re.findall(r"(?<![-\w])width:\s*([^;]+)", attrs.get("style") or "")
            if any(re.fullmatch(r"\s*\d+(\.\d+)?(px)?\s*", w) and float(re.sub(r"[^\d.]", "", w)) > 320
                   for w in widths if w):
                self.fixed_width_images.append(attrs.get("src"))
        if tag in self.VOID:
            return
        main = self._inside("main")
        if main and tag == "table" and not self._inside("table-wrapper"):
            self.unwrapped.append("table")
        if main and tag == "div" and "math" in classes and not self._inside("math-wrapper"):
            self.unwrapped.append("display maths")
        self.stack.append((tag, classes | ({"main"} if attrs.get("role") == "main" else set())))
        if tag == "code" and self.code is None and not any(t == "pre" for t, _ in self.stack):
            self.code = [len(self.stack), ""]

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        while self.stack:
            name, _ = self.stack.pop()
            if self.code is not None and len(self.stack) < self.code[0]:
                self.inline_code.append(self.code[1])
                self.code = None
            if name == tag:
                break

    def handle_data(self, data):
        if self.code is not None:
            self.code[1] += data


# Inline code longer than this without a space is too long to read even where
# the stylesheet breaks it: write it as a code block (which scrolls) instead.
MAX_INLINE_CODE_WORD = 60


@pytest.mark.slow
def test_pages_fit_a_phone_screen(html_build):
    """Nothing in the main text of a page widens it beyond a 390 px screen:
    tables and display maths scroll in their own box, images scale down,
    inline code may break (d3p.css) and has no word too long to read."""
    _, html = html_build
    css = (DOCS / "_static" / "d3p.css").read_text(encoding="utf-8")
    rules = dict(re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.S)))
    rules = {" ".join(k.split()): v for k, v in rules.items()}
    assert "overflow-wrap: anywhere" in rules.get("article code.literal, article .sig", ""), rules
    assert "white-space: normal" in rules.get("article code.literal span.pre, article .sig span.pre", ""), rules
    problems = []
    for path in _built_pages(html):
        if path.name in {"genindex.html", "py-modindex.html", "search.html"} or "_modules" in path.parts:
            continue  # generated indexes and the highlighted sources (literal blocks that scroll)
        parser = _LayoutParser()
        parser.feed(path.read_text(encoding="utf-8"))
        page = path.relative_to(html)
        problems += [f"{page}: {what} outside a scroll container" for what in parser.unwrapped]
        problems += [f"{page}: image {src} has a fixed width" for src in parser.fixed_width_images]
        problems += [f"{page}: inline code word of {len(word)} characters: {word}"
                     for code in parser.inline_code for word in code.split() if len(word) > MAX_INLINE_CODE_WORD]
    assert not problems, "\n".join(problems)


def test_layout_parser_finds_what_overflows():
    """The check above can fail: it sees an unwrapped table, unwrapped display
    maths, a fixed-width image and a long inline code word."""
    parser = _LayoutParser()
    parser.feed('<article role="main"><table><tr><td>x</td></tr></table>'
                '<div class="math-wrapper"><div class="math">ok</div></div><div class="math">x</div>'
                '<img src="a.png" width="800"><img src="b.png" style="width: 900px">'
                '<img src="c.png" width="100%">'
                '<p><code class="literal"><span class="pre">' + "a" * 70 + '</span></code></p>'
                '<div class="table-wrapper"><table><tr><td>ok</td></tr></table></div>'
                '<pre><code>' + "b" * 90 + '</code></pre></article>')
    assert parser.unwrapped == ["table", "display maths"]
    assert parser.fixed_width_images == ["a.png", "b.png"]
    assert parser.inline_code == ["a" * 70]


# ---------------------------------------------------------------------------
# the example gallery (docs/gallery.py writes it; its pages are committed)
# ---------------------------------------------------------------------------

EXAMPLES = ROOT / "examples"
GALLERY = DOCS / "gallery"
EXAMPLE_SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
MAX_FIGURE_BYTES = 150_000


def _recorded_commands(page_text):
    """The commands in a page's ``sh`` code blocks."""
    return [line.strip() for block in re.findall(r"^```sh\n(.*?)^```", page_text, flags=re.S | re.M)
            for line in block.splitlines() if line.strip()]


def _figures(page_text):
    return re.findall(r"^```\{figure\} (\S+)", page_text, flags=re.M)


def _check_gallery_page(page, script):
    """Problems with the gallery page ``page`` of ``examples/<script>``."""
    text = page.read_text(encoding="utf-8")
    problems = []
    if _recorded_commands(text) != [f"python examples/{script} --quick"]:
        problems.append(f"{page.name}: records {_recorded_commands(text)}, not python examples/{script} --quick")
    if "quick run" not in text:
        problems.append(f"{page.name}: does not say that its output is from a quick run")
    output = re.search(r"^## Output\n\n(`{3,})text\n(.+?)\n\1$", text, flags=re.M | re.S)
    if not output:
        problems.append(f"{page.name}: no printed output")
    elif re.search(r"(?<![\w.])/(tmp|home|Users|var|private)/", output.group(2)) or str(ROOT) in output.group(2):
        problems.append(f"{page.name}: the printed output shows a path of the machine that ran it")
    if f"```{{literalinclude}} ../../examples/{script}\n" not in text:
        problems.append(f"{page.name}: does not include the source of {script}")
    writes_png = ".png" in (EXAMPLES / script).read_text(encoding="utf-8")
    figures = _figures(text)
    if writes_png and not figures:
        problems.append(f"{page.name}: {script} writes figures, the page shows none")
    for figure in figures:
        path = page.parent / figure
        if not path.is_file() or path.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            problems.append(f"{page.name}: {figure} is not a PNG file")
        elif path.stat().st_size > MAX_FIGURE_BYTES:
            problems.append(f"{page.name}: {figure} has {path.stat().st_size} bytes")
    if str(ROOT) in text:
        problems.append(f"{page.name}: shows the path of this checkout")
    return problems


def test_gallery_has_a_page_per_example():
    """Every example has a gallery page with the command it records (matching
    its file name), its printed output, its figures (PNG, small) and source."""
    problems = []
    for script in EXAMPLE_SCRIPTS:
        page = GALLERY / f"{script[:-3]}.md"
        if not page.is_file():
            problems.append(f"{script} has no gallery page (run: python docs/gallery.py {script})")
            continue
        problems += _check_gallery_page(page, script)
    gallery = _gallery_module()
    for script in EXAMPLE_SCRIPTS:
        page = GALLERY / f"{script[:-3]}.md"
        if page.is_file() and page.read_text(encoding="utf-8") != gallery.page(
                script, *gallery.describe(script), *gallery.recorded(page)):
            problems.append(f"{page.name} is out of date with {script}'s docstring or with docs/gallery.py "
                            f"(run: python docs/gallery.py --no-run {script})")
    if (GALLERY / "index.md").read_text(encoding="utf-8") != gallery.index(gallery.example_scripts()):
        problems.append("docs/gallery/index.md is out of date (run: python docs/gallery.py --no-run)")
    pages = {p.name for p in GALLERY.glob("*.md")} - {"index.md"}
    problems += [f"{name} shows no example" for name in sorted(pages - {f"{s[:-3]}.md" for s in EXAMPLE_SCRIPTS})]
    index = (GALLERY / "index.md").read_text(encoding="utf-8")
    for script in EXAMPLE_SCRIPTS:
        if f"]({script[:-3]}.md)" not in index:
            problems.append(f"the gallery's index does not link {script[:-3]}.md")
    assert not problems, "\n".join(problems)


def test_gallery_page_check_can_fail(tmp_path):
    page = tmp_path / "gmm.md"
    page.write_text("# GMM\n\n```sh\npython examples/vae.py --quick\n```\n\n"
                    "## Output\n\n```text\nWrote /tmp/x/gmm_fit.png\n```\n")
    problems = _check_gallery_page(page, "gmm.py")
    assert any("not python examples/gmm.py --quick" in p for p in problems)
    assert any("quick run" in p for p in problems)
    assert any("writes figures" in p for p in problems)
    assert any("source" in p for p in problems)
    assert any("path of the machine" in p for p in problems)


def _gallery_module():
    """``docs/gallery.py``, imported (it runs nothing on import)."""
    sys.path.insert(0, str(DOCS))
    try:
        return importlib.import_module("gallery")
    finally:
        sys.path.remove(str(DOCS))


def test_gallery_script_knows_every_example():
    gallery = _gallery_module()
    assert sorted(gallery.example_scripts()) == EXAMPLE_SCRIPTS
    assert gallery.command("gmm.py") == "python examples/gmm.py --quick"


@pytest.mark.examples
def test_gallery_regenerates_a_page(tmp_path):
    """``docs/gallery.py SCRIPT`` runs the example and writes a page in the
    format of the committed ones."""
    script = "choosing_parameters.py"
    proc = subprocess.run([sys.executable, str(DOCS / "gallery.py"), script, "--gallery-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = tmp_path / "choosing_parameters.md"
    assert "Wrote " in proc.stdout and page.is_file(), proc.stdout
    assert _check_gallery_page(page, script) == []
    text = page.read_text(encoding="utf-8")
    assert "Wrote examples/output/choosing_parameters.png" in text
    headings = re.findall(r"^#+ .*$", text, flags=re.M)
    committed = re.findall(r"^#+ .*$", (GALLERY / "choosing_parameters.md").read_text(encoding="utf-8"), flags=re.M)
    assert headings == committed
    assert (tmp_path / "index.md").is_file()


@pytest.mark.parametrize("module_name", DOCTEST_MODULES)
@pytest.mark.float32
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    assert tests, f"{module_name} has '>>>' in its source but no doctest was found"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    for test in tests:
        runner.run(test, out=report.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, report.getvalue()
