"""MkDocs hook of copse's docs site.

- Adds the generated reference pages (``copse.cli.reference``) at build time, so they are never stale.
- Lets pages link to files of the repository outside ``docs/`` (``../examples/...``,
  ``../benchmarks/RESULTS.md``), as they do on GitHub: each such file is added to the site under
  ``repo/`` and the link is rewritten to it. A link to a repository file that does not exist fails
  the build, like any other broken link in ``mkdocs build --strict``.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from copse.cli.reference import render

LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
"""A Markdown inline link's target, without its anchor."""
REPO_PREFIX = "repo"


def _root(config: Any) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _outside(page_uri: str, target: str, docs_dir: Path, root: Path) -> str | None:
    """The repository path a link from ``page_uri`` points at when it leaves ``docs/``, else None."""
    if "://" in target or target.startswith(("mailto:", "/")):
        return None
    resolved = (docs_dir / posixpath.dirname(page_uri) / target).resolve()
    if resolved.is_relative_to(docs_dir):
        return None
    if not resolved.is_relative_to(root):
        raise PluginError(f"docs/{page_uri}: link {target!r} leaves the repository")
    return resolved.relative_to(root).as_posix()


def on_files(files: Files, config: Any) -> Files:
    root = _root(config)
    docs_dir = Path(config["docs_dir"]).resolve()
    for path, text in render(root).items():
        if files.get_file_from_path(path) is not None:
            raise PluginError(f"docs/{path} is generated at build time; delete the file")
        files.append(File.generated(config, path, content=text))
    added: set[str] = set()
    for file in list(files.documentation_pages()):
        if file.abs_src_path is None:
            continue
        for match in LINK.finditer(Path(file.abs_src_path).read_text()):
            target = _outside(file.src_uri, match.group(2), docs_dir, root)
            if target is None or target in added:
                continue
            if not (root / target).is_file():
                raise PluginError(f"docs/{file.src_uri}: link {match.group(2)!r}: no file {target}")
            added.add(target)
            files.append(File.generated(config, f"{REPO_PREFIX}/{target}", abs_src_path=str(root / target)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    root = _root(config)
    docs_dir = Path(config["docs_dir"]).resolve()
    page_uri = page.file.src_uri

    def rewrite(match: re.Match[str]) -> str:
        if page_uri.startswith(REPO_PREFIX):
            return match.group(0)
        target = _outside(page_uri, match.group(2), docs_dir, root)
        if target is None:
            return match.group(0)
        relative = posixpath.relpath(f"{REPO_PREFIX}/{target}", posixpath.dirname(page_uri) or ".")
        return f"{match.group(1)}{relative}{match.group(3)}"

    return LINK.sub(rewrite, markdown)
