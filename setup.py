"""Build the optional C kernels (durablekv._native); everything else is in pyproject.toml.

The extension is optional: when there is no C compiler, or the build fails
for any other reason, the install goes on without it and durablekv runs its
pure-Python code (``durablekv.accelerated`` then says so, and why). Set
``DURABLEKV_REQUIRE_NATIVE=1`` to make a failed build fail the install.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class optional_build_ext(build_ext):
    """build_ext that warns instead of failing when the extension cannot be built."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler: distutils raises its own error types
            self._skip(exc)

    def build_extension(self, ext):
        # First with zlib's CRC-32 (the one Python's zlib module uses, faster
        # on long records than the kernel's own); without it where the
        # headers or the library are missing.
        with_zlib = Extension(ext.name, ext.sources, extra_compile_args=ext.extra_compile_args,
                              define_macros=[("DURABLEKV_ZLIB", "1")], libraries=["z"])
        try:
            super().build_extension(with_zlib)
            return
        except Exception:
            pass
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(exc)

    def _skip(self, exc):
        if os.environ.get("DURABLEKV_REQUIRE_NATIVE", "") not in ("", "0"):
            raise exc
        sys.stderr.write(
            f"WARNING: durablekv's C kernels (durablekv._native) were not built ({exc}); "
            "durablekv is installed with its pure-Python code, which reads and writes the "
            "same files. Install a C compiler and the Python headers (Debian: apt-get "
            "install gcc python3-dev) and reinstall to get the fast path.\n")


setup(
    ext_modules=[Extension("durablekv._native", ["durablekv/_native.c"],
                           extra_compile_args=["-O2"])],
    cmdclass={"build_ext": optional_build_ext},
)
