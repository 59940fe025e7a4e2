"""Tools that read what a job left behind: flight-recorder dumps (:mod:`.flightrec`).

Run by the diagnoser, the agent and ``trainguard fr``; outside the contract, which only
carries their findings as data, and never loaded by a rank.
"""
