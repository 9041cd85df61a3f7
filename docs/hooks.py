"""MkDocs hooks (mkdocs.yml ``hooks:``): the docstrings' Sphinx cross-reference roles (``:func:`x```,
``:class:`x```) shown as the code they name, which is what a reader of the source sees."""

from __future__ import annotations

import re

SPHINX_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj|py:\w+):(<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return SPHINX_ROLE.sub(r"\1", html)
