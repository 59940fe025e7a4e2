"""Tools that read what a job left behind: flight-recorder dumps (:mod:`.flightrec`); and
a model of what failures cost a large job (:mod:`.goodput`).

The first run by the diagnoser, the agent and ``trainguard fr``, the second by
``bench/bench_goodput.py``; outside the contract, which only carries their findings as
data, and never loaded by a rank.
"""
