"""Packaging beyond pyproject.toml: the start-up hook ``flowexec-accelerate.pth``.

Hugging Face's Trainer finds the backend by name only if accelerate knows the name before
anything imports flowexec (see ``_flowexec_accelerate.py``). A ``.pth`` file in site-packages is
how a package runs a line at interpreter start-up; setuptools has no declarative way to ship one,
so the wheel's build (``build_py``) and the editable install's (``editable_wheel``) each put it at
the wheel's root.
"""
from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "flowexec-accelerate.pth"
# One line, run by site at start-up: imports only the tiny hook module, never raises.
PTH_LINE = ("import sys; exec('try:\\n import _flowexec_accelerate\\n _flowexec_accelerate.install_quietly()\\n"
            "except Exception:\\n pass')\n")


def write_pth(root: str) -> None:
    with open(os.path.join(root, PTH), "w") as f:
        f.write(PTH_LINE)


class build_py_with_pth(build_py):
    """build_py that also writes the start-up hook into the wheel's root."""

    def run(self) -> None:
        super().run()
        write_pth(self.build_lib)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass: dict[str, type] = {"build_py": build_py_with_pth}
try:  # editable installs (PEP 660) build their wheel apart from build_py's outputs
    from setuptools.command.editable_wheel import editable_wheel

    class editable_wheel_with_pth(editable_wheel):
        """editable_wheel that also puts the start-up hook at the editable wheel's root."""

        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):  # type: ignore[no-untyped-def]
            out = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            write_pth(unpacked_wheel)
            return out

    cmdclass["editable_wheel"] = editable_wheel_with_pth
except ImportError:  # setuptools older than editable wheels
    pass

setup(cmdclass=cmdclass)
