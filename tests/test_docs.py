"""The documentation: README.md is a landing page, docs/ builds as a strict MkDocs site, and links resolve.

The site's configuration is mkdocs.yml (MkDocs and mkdocstrings are in pyproject's ``dev`` extra).
"""

import importlib
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")
README_MAX_BYTES = 15_000
# A markdown link or image: [text](target) / ![alt](target), the target without spaces.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# Where the code reads its MONARCH_TENSOR_* variables (dev.sh reads MONARCH_TENSOR_VENV).
CODE_DIRS = ("monarch_tensor", "controller", "worker", "rdma")
ENV_NAME = re.compile(r"MONARCH_TENSOR_[A-Z0-9_]*[A-Z0-9]\b")


def _markdown_files() -> list[str]:
    return [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))


def _links(path: str) -> list[str]:
    """The link targets of a markdown file, leaving out code (fenced blocks and code spans)."""
    text = open(path, encoding="utf-8").read()
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def test_readme_is_a_landing_page():
    size = os.path.getsize(README)
    assert size < README_MAX_BYTES, (f"README.md is {size} bytes; it is the landing page (under "
                                     f"{README_MAX_BYTES}): move details into a page of docs/")


def test_relative_links_point_to_files():
    bad = []
    checked = 0
    for path in _markdown_files():
        for target in _links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page (mkdocs --strict checks those in docs/)
            checked += 1
            file = target.split("#", 1)[0]
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), file))):
                bad.append(f"{os.path.relpath(path, ROOT)}: {target}")
    assert checked > 20, "found almost no relative links: is the link pattern broken?"
    assert not bad, "links to files that do not exist:\n" + "\n".join(bad)


def test_readme_snippets_import_real_names():
    """Every ``from monarch_tensor... import a, b`` in README's code blocks names something that exists."""
    text = open(README, encoding="utf-8").read()
    imports = re.findall(r"^\s*from (monarch_tensor[\w.]*) import ([\w, ]+)$", text, re.M)
    assert imports, "README.md's examples import nothing from monarch_tensor"
    missing = []
    for module, names in imports:
        mod = importlib.import_module(module)
        missing += [f"{module}.{n.strip()}" for n in names.split(",") if not hasattr(mod, n.strip())]
    assert not missing, f"README.md imports names that do not exist: {missing}"


def test_settings_reference_names_every_variable():
    from monarch_tensor.config import SETTINGS

    page = open(os.path.join(DOCS, "settings.md"), encoding="utf-8").read()
    read = set()
    for top in CODE_DIRS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    read |= set(ENV_NAME.findall(open(os.path.join(dirpath, f), encoding="utf-8").read()))
    assert len(read) > 30, sorted(read)
    undocumented = sorted(n for n in read if f"`{n}`" not in page)
    assert not undocumented, f"docs/settings.md does not describe {undocumented}"
    options = sorted(n for n in SETTINGS if f"`{n}`" not in page or f"`MONARCH_TENSOR_{n.upper()}`" not in page)
    assert not options, f"docs/settings.md does not describe the configure() options {options}"


@pytest.mark.timeout(300)
def test_docs_build_strict(tmp_path):
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings_handlers.python  # noqa: F401
    except ImportError as e:
        pytest.fail(f"{e}: the docs need pyproject's dev extra (bash dev.sh setup installs it)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", os.path.join(ROOT, "mkdocs.yml"),
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for page in ("index.html", "settings/index.html", "api/index.html", "limitations/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("spawn_procs", "module_to_mesh", "RDMABuffer", "SlurmJob", "configure"):
        assert name in api, f"the API reference lacks {name}"
