"""The Redis users a replicated deployment needs beside the roles: replication and Sentinel.

With ACLs on (the default user off), a replica must log in to its primary to replicate, and
each sentinel to every data node to watch it and, on a failover, promote a replica and
repoint the others. Each gets a user with only the commands it needs (Redis' own lists for
``masteruser`` and ``sentinel auth-user``), one password shared by every node of the set,
and the config lines that hand the secrets to the servers, so the shipped
``deploy/redis-ha.conf`` and ``deploy/sentinel.conf`` only ``include`` files written here
(by ``trainguard credentials --out DIR``).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Final

REPLICATION_USER: Final = "replication"
SENTINEL_USER: Final = "sentinel"
MASTER_NAME: Final = "trainguard"
"""The name the shipped sentinels know the primary by (the Sentinel URL's master name)."""


@dataclasses.dataclass(frozen=True)
class HaSecrets:
    replication: str
    sentinel: str

    @classmethod
    def generate(cls) -> HaSecrets:
        return cls(secrets.token_urlsafe(24), secrets.token_urlsafe(24))

    def acl_lines(self) -> str:
        """The two users, for the data nodes' ACL file (beside the roles' users)."""
        return (f"user {REPLICATION_USER} on >{self.replication} resetkeys resetchannels "
                "-@all +psync +replconf +ping\n"
                f"user {SENTINEL_USER} on >{self.sentinel} resetkeys allchannels -@all "
                "+multi +slaveof +ping +exec +subscribe +config|rewrite +role +publish "
                "+info +client|setname +client|kill +script|kill\n")

    def data_node_conf(self) -> str:
        """``include``d by every data node: how a replica logs in to its primary."""
        return f"masteruser {REPLICATION_USER}\nmasterauth {self.replication}\n"

    def sentinel_conf(self, master: str = MASTER_NAME) -> str:
        """``include``d by every sentinel (after its ``sentinel monitor`` line): how it logs
        in to the data nodes."""
        return (f"sentinel auth-user {master} {SENTINEL_USER}\n"
                f"sentinel auth-pass {master} {self.sentinel}\n")
