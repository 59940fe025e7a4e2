"""In-place recovery, in one home: survivors keep their processes while a lost rank is
replaced (docs/design.md, "In-place recovery").

The group store and generations (:mod:`.groupstore`), the command agreement
(:mod:`.agreement`, on a gloo side group, :mod:`.sidegroup`), the Guard's plug point and
loop (:mod:`.loop`), the Protocol of the Guard that the recovery and the torch helpers type
against (:mod:`.handle`), state transfer (:mod:`.statesync`), peer loss (:mod:`.peerloss`),
the DDP rebuild (:mod:`.ddprebuild`), ``InPlace`` and ``init_process_group``
(:mod:`.inplace`), and the agent's rule of in place or restart (:mod:`.path`).

Imports :mod:`trainguard.contract` and :mod:`trainguard.core`; the client builds on the
torch-free modules (agreement, loop, handle), the torch helpers and the agent on the rest.
"""
