"""A griffe extension for the API pages: the docstrings' reST roles (:class:`X`, :mod:`~a.b`, ``code``) as
Markdown code, since the docstrings are read as Google style (mkdocs.yml, ``extensions``)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|mod|func|data|meth|attr|obj|exc):`~?([^`]+)`")


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _ROLE.sub(lambda m: f"`{m.group(1).replace(' ', '')}`", obj.docstring.value)
            obj.docstring.value = text.replace("``", "`")
