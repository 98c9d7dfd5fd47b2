"""``ssh``: any host reachable over SSH, in a set working directory.

No lifecycle on the host: hutch neither makes nor removes it, and closing the
sandbox leaves the host and its files as they are. Commands travel over one
kept, multiplexed connection per destination (:mod:`.connection`), files over
SFTP (:mod:`.files`).
"""

from .config import SshConfig

__all__ = ["SshConfig"]
