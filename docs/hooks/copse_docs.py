"""MkDocs hook of copse's docs site.

- Adds the generated reference pages (``copse.cli.reference``) at build time, so they are never stale.
- Lets pages link to files of the repository outside ``docs/`` (``../examples/...``,
  ``../benchmarks/RESULTS.md``, ``../README.md``), as they do on GitHub: each such file is added to
  the site under ``repo/`` and the link is rewritten to it; links inside an added Markdown file are
  followed and rewritten the same way. A link to a repository file that does not exist fails the
  build, like any other broken link in ``mkdocs build --strict``.
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
REPO_PREFIX = "repo/"


def _paths(config: Any) -> tuple[Path, Path]:
    """The repository root (where mkdocs.yml is) and the docs directory."""
    return Path(config["config_file_path"]).resolve().parent, Path(config["docs_dir"]).resolve()


def _source_dir(src_uri: str, root: Path, docs_dir: Path) -> Path:
    """Where the file behind a site path lives: docs/… or, for ``repo/…``, the repository."""
    if src_uri.startswith(REPO_PREFIX):
        return root / posixpath.dirname(src_uri.removeprefix(REPO_PREFIX))
    return docs_dir / posixpath.dirname(src_uri)


def _site_path(src_uri: str, target: str, root: Path, docs_dir: Path) -> str | None:
    """The site path a relative link of ``src_uri`` points at, None for URLs and absolute paths."""
    if "://" in target or target.startswith(("mailto:", "/")):
        return None
    resolved = (_source_dir(src_uri, root, docs_dir) / target).resolve()
    if resolved.is_relative_to(docs_dir):
        return resolved.relative_to(docs_dir).as_posix()
    if not resolved.is_relative_to(root):
        raise PluginError(f"{src_uri}: link {target!r} leaves the repository")
    return REPO_PREFIX + resolved.relative_to(root).as_posix()


def on_files(files: Files, config: Any) -> Files:
    root, docs_dir = _paths(config)
    for path, text in render(root).items():
        if files.get_file_from_path(path) is not None:
            raise PluginError(f"docs/{path} is generated at build time; delete the file")
        files.append(File.generated(config, path, content=text))
    pending = [file for file in files.documentation_pages() if file.abs_src_path is not None]
    while pending:
        file = pending.pop()
        assert file.abs_src_path is not None
        for match in LINK.finditer(Path(file.abs_src_path).read_text()):
            site = _site_path(file.src_uri, match.group(2), root, docs_dir)
            if site is None or not site.startswith(REPO_PREFIX) or files.get_file_from_path(site):
                continue
            source = root / site.removeprefix(REPO_PREFIX)
            if not source.is_file():
                missing = source.relative_to(root)
                raise PluginError(f"{file.src_uri}: link {match.group(2)!r}: no file {missing}")
            added = File.generated(config, site, abs_src_path=str(source))
            files.append(added)
            if added.is_documentation_page():
                pending.append(added)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    root, docs_dir = _paths(config)
    page_uri = page.file.src_uri

    def rewrite(match: re.Match[str]) -> str:
        site = _site_path(page_uri, match.group(2), root, docs_dir)
        if site is None or not (site.startswith(REPO_PREFIX) or page_uri.startswith(REPO_PREFIX)):
            return match.group(0)  # a link between docs pages: mkdocs resolves and checks it
        relative = posixpath.relpath(site, posixpath.dirname(page_uri) or ".")
        return f"{match.group(1)}{relative}{match.group(3)}"

    return LINK.sub(rewrite, markdown)
