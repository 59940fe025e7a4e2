"""Small instrumented trainers (the README's loop, for real) that the demo, the tests and
the benchmarks run as ranks: the top layer's users of the Guard and the torch helpers."""
