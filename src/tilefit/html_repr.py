"""The notebook's view of a result: ``_repr_html_``, which Jupyter and IPython call to show
an object. Torch-free, a leaf. The results live below report/, which renders them, and may
not import it (docs/architecture.md, Layering): they inherit ``HtmlRepr``, and the package
(``tilefit/__init__``, the top tier, imported before any of its modules) installs
report.notebook's renderer here."""

from __future__ import annotations

from collections.abc import Callable

Renderer = Callable[[object], str]
_installed: list[Renderer] = []


def install(renderer: Renderer) -> None:
    """Make ``renderer`` (a result -> an HTML fragment) the one every result's
    ``_repr_html_`` calls."""
    _installed[:] = [renderer]


class HtmlRepr:
    """A result's ``_repr_html_``: the installed renderer's fragment (None before one is
    installed, so the notebook shows the plain repr)."""

    __slots__ = ()

    def _repr_html_(self) -> str | None:
        return _installed[0](self) if _installed else None
