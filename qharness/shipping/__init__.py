"""``qharness ship CONFIG --max_ppl_increase 2%``: which recipe to ship. Climbs a ladder of candidates from the
cheapest to the costliest (``ladder.py``), each a real ``.pte`` through the parity gate, scored against FP on the
same held-out blocks, timed in one joint benchmark; stops when further rungs cannot change the answer and picks the
smallest (or fastest) candidate that meets the tolerance beyond the noise (``decide.py``).

Built on the sweep: each rung is a sweep of its candidates in the one ship directory, so a finished candidate is
reused by a re-run (a killed ship continues from its finished rungs) and every candidate is a row of the report.

Modules, in the order a ship uses them: ``spec.py`` (the ship config, the tolerance and budgets checked),
``ladder.py`` (the rungs as data), ``decide.py`` (meets / fits / the pick / ties / the closest / cannot win),
``climb.py`` (``run_ship``: the rungs, the joint benchmark, the chosen files), ``record.py`` (``ship.json`` as
``ShipRecord``, ``ship.md``).
"""
