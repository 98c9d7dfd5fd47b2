"""When a chain of layers is flattened: the one rule for every chain hutch
stacks (issue 21).

Three layer systems stack a snapshot's files as a chain, and each has a
ceiling on how many layers one mount can stack: ``local``'s and
``docker``'s working directories here (overlayfs, whose mount options must
fit one page: :data:`MAX_LAYERS`), docker's images (overlay2 stops at 128:
the docker provider's ``MAX_SUSPEND_LAYERS``), and bubblewrap's root file
systems (its own overlay, whose options it checks when it mounts them).
Each asks :func:`flattens` whether a capture flattens the chain it adds to,
with its own ceiling: what flattening costs and makes differs by system (a
copy of the merged view here, a single-layer image there), the rule does
not.
"""

from __future__ import annotations

#: Layers one chain may stack before a capture flattens it: overlayfs takes
#: up to 500 lower directories, but the mount options must fit one page.
MAX_LAYERS = 24


#: The ``limit`` of a chain with no ceiling by depth: it flattens only when asked.
NO_CEILING = 0


def flattens(depth: int, *, asked: bool, limit: int | None = None) -> bool:
    """Whether a capture over a chain of ``depth`` layers flattens it into
    one: when the caller asks (``diff=False``, a ``flatten``), or when the
    chain already stacks ``limit`` layers (:data:`MAX_LAYERS` when not
    given; :data:`NO_CEILING`: never unasked, for a system with no ceiling by
    depth: bubblewrap checks its mount's options instead)."""
    ceiling = MAX_LAYERS if limit is None else limit
    return asked or (ceiling > 0 and depth >= ceiling)
