"""``trainguard demo``: a real multi-process training job, hit by the failures of docs/design.md
section 6, recovering by itself while you watch."""
