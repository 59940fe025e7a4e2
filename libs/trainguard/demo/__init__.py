"""``trainguard demo``: a real multi-process training job, hit by the failures of
docs/design.md section 6, recovering by itself while you watch.

It runs the control plane and agents as processes (the embedded servers of
:mod:`trainguard.runtime.embedded`) and speaks to them over the bus: it imports the
contract, core and runtime, never a service or the agent directly."""
