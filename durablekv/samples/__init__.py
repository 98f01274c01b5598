"""A small trace shipped with the package, so ``durablekv replay`` has real input anywhere.

``web-sample.csv``: 10,000 requests of generated web-like look-aside traffic
(gets, sets with TTLs, deletes, value sizes) in CacheLib's CSV format. It is
written by ``bench/make_sample_trace.py`` in the repository (seeded, byte for
byte reproducible) and contains no third-party data; the real public traces
it stands in for, and where to get them, are listed in docs/cli.md.
"""

from pathlib import Path

#: Path of ``web-sample.csv`` inside the installed package.
WEB_SAMPLE = Path(__file__).with_name("web-sample.csv")
