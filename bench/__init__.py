"""durablekv's side-by-side benchmark suite (``python -m bench --help``).

Every case runs durablekv and its competitors in the same process run,
interleaved: within each repetition the implementations take turns
(round-robin, the starting one rotating from repetition to repetition), so a
slow phase of the machine hits all of them alike. Each case reports the
median over the repetitions and the spread (min, max and the interquartile
range). Results go to a JSON file and a markdown table; nothing in the
tables, plots or ``docs/performance.md`` is typed by hand.

Modules (one per group of cases):

``cli``        argparse, orchestration, the JSON file
``util``       timing statistics, calibration, machine description, temp dirs
``impls``      one adapter per implementation (durablekv, dict, OrderedDict,
               functools.lru_cache, cachetools, diskcache, sqlitedict, lmdb, Redis)
``redis_server`` starts and stops a private redis-server on loopback
``micro``      per-operation costs (get hit, page fault, miss, set, delete, mix)
``sustained``  10 s of unique-key sets, durablekv vs raw SQLite executemany,
               each run in a subprocess that also reports its peak RSS
``macro``      look-aside replays of the real traces in ../shared/traces
``sim``        LRU, durablekv's page-LRU and Belady's OPT simulators
``restart``    reopen after a clean close; recovery after SIGKILL
``memory``     bytes per resident entry (tracemalloc)
``plots``      hit-ratio curves and throughput bars (matplotlib, Agg)
``report``     the markdown table, the targets, docs/performance.md
``profile``    cProfile of durablekv's slowest cases (``python -m bench.profile``)
"""
