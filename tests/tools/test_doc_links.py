"""Every relative link of the Markdown documentation resolves: the file or
folder it names is in the repository, and an anchor names a heading of the
page it points into."""

import os
import re
import subprocess

import pytest

# The repository root (this file is tests/tools/test_doc_links.py).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _repository_files() -> set[str]:
  """Tracked files, relative to the root with "/" separators; every file
  under the root where git cannot list them."""
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=_ROOT, check=True,
                         capture_output=True).stdout.decode()
    files = {f for f in out.split("\0") if f}
    if files:
      return files
  except (OSError, subprocess.CalledProcessError):
    pass
  files = set()
  for folder, dirs, names in os.walk(_ROOT):
    dirs[:] = [d for d in dirs if not d.startswith(".")]
    for name in names:
      files.add(os.path.relpath(os.path.join(folder, name),
                                _ROOT).replace(os.sep, "/"))
  return files


_FILES = _repository_files()
_FOLDERS = {f.rsplit("/", 1)[0] for f in _FILES if "/" in f}
_FOLDERS |= {"/".join(f.split("/")[:i]) for f in _FOLDERS
             for i in range(1, f.count("/") + 1)}
_PAGES = sorted(f for f in _FILES if f.endswith(".md"))


def _read(path: str) -> str:
  with open(os.path.join(_ROOT, path), encoding="utf-8") as f:
    return f.read()


def _text_lines(text: str) -> list[str]:
  """The lines of Markdown text outside fenced code blocks."""
  lines, fenced = [], False
  for line in text.splitlines():
    if _FENCE.match(line):
      fenced = not fenced
    elif not fenced:
      lines.append(line)
  return lines


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
  """The anchors of the headings of Markdown text."""
  seen: dict[str, int] = {}
  anchors = set()
  for line in _text_lines(text):
    match = _HEADING.match(line)
    if not match:
      continue
    slug = _slug(match.group(2))
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f"{slug}-{count}")
  return anchors


def _links(text: str) -> list[str]:
  """The link targets of Markdown text, outside code."""
  links = []
  for line in _text_lines(text):
    line = re.sub(r"`[^`]*`", "", line)
    links += _LINK.findall(line)
    match = _REFERENCE.match(line)
    if match:
      links.append(match.group(1))
  return links


def _problem(page: str, target: str) -> str | None:
  """Why ``target``, a link on ``page``, does not resolve (None if it
  does)."""
  if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
    return None  # a URL (https:, mailto:)
  path, _, anchor = target.partition("#")
  if path:
    if path.startswith("/"):
      return "an absolute path"
    joined = os.path.normpath(os.path.join(os.path.dirname(page), path))
    resolved = joined.replace(os.sep, "/")
    if resolved.startswith("../") or resolved == "..":
      return "outside the repository"
    if resolved not in _FILES and resolved not in _FOLDERS | {"."}:
      return "no such file in the repository"
  else:
    resolved = page
  if anchor and resolved.endswith(".md") and resolved in _FILES:
    if anchor.lower() not in _anchors(_read(resolved)):
      return f"no heading #{anchor} in {resolved}"
  return None


def test_the_documentation_has_pages_to_check():
  assert "README.md" in _PAGES
  assert any(p.startswith("docs/") for p in _PAGES)


@pytest.mark.parametrize("page", _PAGES)
def test_relative_links_resolve(page):
  dangling = [f"{target}: {why}" for target in _links(_read(page))
              if (why := _problem(page, target)) is not None]
  assert not dangling, f"{page}: " + "; ".join(dangling)


def test_a_dangling_link_is_found():
  assert _problem("docs/page.md", "../README.md") is None
  assert _problem("docs/page.md", "../benchmarks/") is None
  assert _problem("docs/page.md", "no-such-page.md") is not None
  assert _problem("README.md", "../outside.md") is not None
  assert _problem("README.md", "/README.md") is not None
  assert _problem("README.md", "https://example.com/x.md") is None
  assert _problem("README.md", "#no-such-heading-anywhere") is not None
  assert _links("See [a](a.md), ![b](b.png \"t\") and `[c](c.md)`.\n"
                "```\n[d](d.md)\n```\n[e]: e.md\n") == \
      ["a.md", "b.png", "e.md"]
  assert _anchors("# A page\n## `mosaic_gpu`: kernels\n## Default order "
                  "(`implementation=None`)\n## A page\n```\n# code\n```\n") \
      == {"a-page", "mosaic_gpu-kernels", "default-order-implementationnone",
          "a-page-1"}
