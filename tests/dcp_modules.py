"""Setting a name of dcp's search for one test, in every module of the search that reads it."""

from __future__ import annotations

import blockattn.planner.dcp as dcp
import blockattn.planner.first_pass as first_pass
import blockattn.planner.passes as passes

MODULES = (dcp, first_pass, passes)


def set_dcp(patch, name: str, value) -> None:
    """``patch.setattr`` (a pytest monkeypatch or its context) of ``name`` on every module of dcp's search
    that has it: a function such as ``_place`` or ``with_deferred_backward`` is imported by several of
    them, and setting it on one would leave the others calling the original. AttributeError where none
    has it (a renamed or moved name), so a test never sets a name nothing reads."""
    found = [module for module in MODULES if hasattr(module, name)]
    if not found:
        raise AttributeError(f"no module of dcp's search ({', '.join(m.__name__ for m in MODULES)}) has {name!r}")
    for module in found:
        patch.setattr(module, name, value)
