"""The public API: ``tokenline.__all__`` is honest and documented."""

from __future__ import annotations

import inspect

import tokenline


def test_every_public_name_exists_and_has_a_docstring() -> None:
    """Each name in __all__ is importable and (unless a constant) documented."""
    missing = [n for n in tokenline.__all__ if not hasattr(tokenline, n)]
    assert missing == []
    undocumented = [
        n
        for n in tokenline.__all__
        if (inspect.isclass(obj := getattr(tokenline, n)) or inspect.isfunction(obj))
        and not inspect.getdoc(obj)
    ]
    assert undocumented == []


def test_all_lists_every_public_module_level_name() -> None:
    """Nothing public is exported without being listed in __all__."""
    public = {
        n
        for n, obj in vars(tokenline).items()
        if not n.startswith("_") and not inspect.ismodule(obj) and n != "annotations"
    }
    assert public <= set(tokenline.__all__)
