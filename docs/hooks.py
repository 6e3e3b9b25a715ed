"""mkdocs hooks (mkdocs.yml): the README is the site's home page.

GitHub shows README.md at the repository root, linking to ``docs/<page>.md``; the site serves it as
``index.md`` inside ``docs/``, so those links lose their ``docs/`` prefix. Nothing is copied into the
tree: the page is generated at build time, so the README stays the one source.
"""
import re
from pathlib import Path

from mkdocs.structure.files import File

README = Path(__file__).resolve().parents[1] / "README.md"


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=README.read_text(encoding="utf-8")))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "index.md":
        markdown = re.sub(r"\]\(docs/", "](", markdown)
    return markdown
