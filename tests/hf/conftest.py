"""The transformers integration's tests need the ``hf`` extra: without transformers they are not collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("transformers") else ["test_*.py"]
