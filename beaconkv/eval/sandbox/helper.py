"""The namespace containment's helper process, started by path:
``python -I -S -B helper.py --beaconkv-sandbox-helper CONFIG.json``.

Run so, with the standard library only (no ``site``: it imports neither beaconkv nor torch and starts in
tens of milliseconds), it loads the modules beside it as a package of their own, without running the
package's ``__init__``, and hands over to :mod:`.namespaces`. Imported, it does nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

_PACKAGE = "_beaconkv_sandbox"  # the name the helper gives the modules beside this file


def _namespaces() -> ModuleType:
    """:mod:`.namespaces`, loaded from beside this file under :data:`_PACKAGE` (its relative imports resolve there)."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(_PACKAGE, os.path.join(here, "__init__.py"),
                                                  submodule_search_locations=[here])
    assert spec is not None
    sys.modules[_PACKAGE] = importlib.util.module_from_spec(spec)  # the package's face is never run
    return importlib.import_module(f"{_PACKAGE}.namespaces")


if __name__ == "__main__":
    namespaces = _namespaces()
    if len(sys.argv) != 3 or sys.argv[1] != namespaces._HELPER_FLAG:
        raise SystemExit(f"usage: python {__file__} {namespaces._HELPER_FLAG} CONFIG.json (internal helper)")
    sys.exit(namespaces._helper_main(sys.argv[2]))
