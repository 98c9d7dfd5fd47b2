"""When a chain of layers is flattened."""

from __future__ import annotations

#: Layers one chain may stack before a capture flattens it: overlayfs takes
#: up to 500 lower directories, but the mount options must fit one page.
MAX_LAYERS = 24
