"""Build declaration for DPLB's native extension; all metadata lives in setup.cfg."""
from Cython.Build import cythonize
from setuptools import Extension, setup

ext = Extension(
    "dplb_shm._native",
    sources=["csrc/dplb_native.pyx"],
    include_dirs=["csrc"],
    depends=["csrc/dplb_shm.h", "csrc/dplb_native.pxd"],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-function"],
)

setup(ext_modules=cythonize([ext], language_level=3, compiler_directives={"boundscheck": False, "wraparound": False}))
