"""The checkpoint coordinator: only complete checkpoints count, saved as often as failures
warrant, on demand within a deadline.

Modules, one job each: ``settings`` (knobs), ``keys`` and ``scripts`` (the Redis layout and
the Lua that keeps it consistent across replicas), ``catalogue`` (async access to it),
``records`` (a checkpoint's record, parsed), ``verify`` (do the files match the reports),
``interval`` (Young/Daly), ``retention`` (what may go), ``latest`` (the LATEST file),
``commands`` (collective commands to ranks),
``savenow`` (save-now with a deadline) and ``service`` (the wiring).
"""
