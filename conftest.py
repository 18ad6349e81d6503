"""pytest's collection from the repository root: modules of the package whose import
needs an optional dependency that is not installed are not collected for their
doctests (``numba_rope/torch.py`` imports torch). Their tests skip on their own."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("torch") is None:
    collect_ignore.append("numba_rope/torch.py")
