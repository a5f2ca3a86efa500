"""The docs site (``mkdocs.yml``, ``docs/``) builds with ``mkdocs build --strict``.

Strict mode turns every warning into a failure: a broken link or anchor between pages, a page in
``docs/`` missing from the nav, a nav entry with no page, and griffe's warnings about the docstrings
that mkdocstrings renders for the API reference.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    site = tmp_path / "site"
    # the API reference rendered the public API from its docstrings, not empty pages
    api = (site / "api" / "deltasync" / "index.html").read_text()
    for name in ("DeltaUploader", "DeltaFetcher", "UploaderConfig", "CommitInfo", "RunReader", "open_store"):
        assert f'id="deltasync.{name}"' in api, name
    for page in ("storage", "signal", "errors", "vllm-driver", "trl", "transformers"):
        assert 'class="doc doc-object' in (site / "api" / page / "index.html").read_text(), page


def test_readme_links_and_the_two_commands() -> None:
    """The README (the landing page, outside the site) links only to files that exist, and its test
    command is the one CI runs (``.ci/run``)."""
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    blocks = re.findall(r"```bash\n(.*?)\n```", readme[readme.index("## Two commands") :], re.S)
    demos = [b for b in blocks if b.endswith("&& deltasync demo")]
    tests = [b for b in blocks if b.endswith("&& python -m pytest")]
    assert len(demos) == len(tests) == 2, blocks  # each a CPU line and a GPU line (tests/docs checks them)
    assert tests[-1] in (ROOT / ".ci" / "run").read_text().splitlines()
