"""What any trainguard process runs, rank or service: tracing, connection options,
credentials and fencing tokens, files, the command receiver, and a rank's identity and
current state.

Imports only :mod:`trainguard.contract`. Nothing here needs Redis, Prometheus or torch: the
client builds on it, so must whatever lives here.
"""
