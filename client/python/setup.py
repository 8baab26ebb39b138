"""Build hook: libkvblend, built with CMake from the checkout, bundled in the package.

``pip install ./client/python`` runs this: CMake configures the checkout this directory
sits in (Release, CUDA off, no tests), builds the one target ``kvblend`` (the shared
client library), and the library goes into the package as ``kvblend/_libs/libkvblend.so.1``,
which ``kvblend._lib`` loads first (after an explicit ``$KVBLEND_LIB``). The library
links libzmq, libsodium and libprotobuf-c from the system (docs/python.md lists them).

Everything else (name, version, dependencies) is in pyproject.toml. Environment:

- ``KVBLEND_BUNDLE=0``: build the package without the library (it is then found as
  docs/python.md says: ``$KVBLEND_LIB``, the checkout's build/, the system's).
- ``CMAKE_BUILD_PARALLEL_LEVEL``: CMake's jobs (default: the CPUs).

An editable install (``pip install -e``) builds nothing: it loads the checkout's
``build/lib/libkvblend.so``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent  # client/python
ROOT = HERE.parent.parent  # the checkout
SONAME = "libkvblend.so.1"  # _lib.py's _SONAMES[0]: keep in step with _ABI


class BinaryDistribution(Distribution):
    """A wheel of this platform: it carries a shared library."""

    def has_ext_modules(self) -> bool:  # noqa: D102
        return True


class BuildPyWithLib(build_py):
    """build_py, then libkvblend built by CMake and copied to kvblend/_libs/."""

    def run(self) -> None:  # noqa: D102
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("KVBLEND_BUNDLE") == "0":
            return
        lib = self._build_lib()
        dest = Path(self.build_lib) / "kvblend" / "_libs"
        dest.mkdir(parents=True, exist_ok=True)
        # The file itself, under its soname: a wheel holds no symbolic links.
        shutil.copyfile(lib.resolve(), dest / SONAME)
        os.chmod(dest / SONAME, 0o755)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:  # noqa: D102
        out = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False) and os.environ.get("KVBLEND_BUNDLE") != "0":
            out.append(str(Path(self.build_lib) / "kvblend" / "_libs" / SONAME))
        return out

    def _build_lib(self) -> Path:
        if not all((ROOT / f).is_file() for f in ("CMakeLists.txt", "client/kvblend.map")):
            raise SystemExit(
                f"kvblend: no kvblend checkout at {ROOT} to build libkvblend from; install from "
                "a checkout (pip install ./client/python), or set KVBLEND_BUNDLE=0 to build "
                "without the library"
            )
        if shutil.which("cmake") is None:
            raise SystemExit(
                "kvblend: cmake is needed to build libkvblend (Debian 12: the build "
                "dependencies in docs/python.md, or bash .ci/install-deps)"
            )
        temp = Path(self.get_finalized_command("build").build_temp).resolve() / "libkvblend"
        cache = temp / "CMakeCache.txt"
        # A build directory kept from a checkout elsewhere (a moved or copied tree): start over.
        if cache.exists() and f"CMAKE_HOME_DIRECTORY:INTERNAL={ROOT}\n" not in cache.read_text():
            shutil.rmtree(temp)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(temp),
            "-DCMAKE_BUILD_TYPE=Release", "-DKVB_CUDA=OFF", "-DKVB_TESTS=OFF",
            "-DKVB_SYSTEMD=OFF", "-DKVB_SANITIZE=OFF", "-DCMAKE_SKIP_RPATH=ON",
        ]  # fmt: skip
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        build = ["cmake", "--build", str(temp), "--target", "kvblend", "-j", jobs]
        for cmd in (configure, build):
            self.announce("kvblend: " + " ".join(cmd), level=2)
            subprocess.run(cmd, check=True)
        lib = temp / "lib" / SONAME
        if not lib.exists():
            raise SystemExit(f"kvblend: CMake built no {lib}")
        return lib


setup(cmdclass={"build_py": BuildPyWithLib}, distclass=BinaryDistribution)
