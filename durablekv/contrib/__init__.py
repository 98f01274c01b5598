"""Backends for the frameworks through which Python code meets a cache.

Each module needs its framework (an optional extra) and is imported on its
own: ``durablekv.contrib.django`` (``pip install 'durablekv[django]'``).
"""
