"""Build declaration for DPLB's native extension; all metadata lives in setup.cfg."""
import importlib.util
import os
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_dplb_sources", HERE / "dplb_shm" / "_sources.py")
_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sources)


class BuildExt(build_ext):
    """build_ext that replaces an in-place extension by unlink + copy, never by overwriting it:
    processes that have the old .so mapped keep running instead of crashing."""

    def copy_file(self, infile, outfile, *args, **kwargs):
        if self.inplace and str(outfile).endswith((".so", ".pyd")) and os.path.exists(outfile):
            os.unlink(outfile)
        return super().copy_file(infile, outfile, *args, **kwargs)


ext = Extension(
    "dplb_shm._native",
    sources=["csrc/dplb_native.pyx"],
    include_dirs=["csrc"],
    depends=["csrc/dplb_shm.h", "csrc/dplb_kernel.h", "csrc/dplb_native.pxd", "csrc/dplb_segment.pxi",
             "csrc/dplb_writer.pxi"],
    define_macros=[("DPLB_SOURCE_SHA256", '"%s"' % _sources.source_hash(HERE / "csrc"))],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function", "-ffp-contract=off"],
)

# the router's stream relay (router/transport.py, Upstream.pipe); not part of the segment's build hash
relay = Extension("router._relay", sources=["csrc/dplb_relay.pyx"],
                  extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"])

# the prompt's per-byte work and the prefix index (dplb_prefix); not part of the segment's build hash
prefix = Extension("dplb_prefix._native", sources=["csrc/dplb_prefix.pyx"], include_dirs=["csrc"],
                   depends=["csrc/dplb_prefix.h"],
                   extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"])

# a prompt's token ids and its blocks' chained keys (the engines' KV-cache events path); not part of
# the segment's build hash
tokens = Extension("dplb_prefix._tokens", sources=["csrc/dplb_tokens.pyx"], include_dirs=["csrc"],
                   depends=["csrc/dplb_tokens.h"],
                   extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"])

setup(
    ext_modules=cythonize([ext, relay, prefix, tokens], language_level=3, include_path=["csrc"],
                          compiler_directives={"boundscheck": False, "wraparound": False}),
    cmdclass={"build_ext": BuildExt},
)
