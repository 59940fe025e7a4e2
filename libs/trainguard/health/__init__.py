"""A node's health: the pre-flight checks (``trainguard preflight``, and ``trainguard
launch`` before its ranks start) and the host probe behind the diagnoser's straggler
checklist.

Readings (sysfs, procfs, the kernel log, ``nvidia-smi -q`` and ``dcgmi diag`` text) are
parsed by small readers, and every check is a pure function over a reading
(:mod:`.checks`), so each is tested against recorded real outputs. Below the agent and the
services, above the runtime: it imports the contract and the runtime's settings and XID
table. Only :mod:`.allreduce` (run as its own process) imports torch; nothing the
services import reaches it.
"""
