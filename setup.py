"""Build hook: ship the Hydra config tree `conf/` inside the package as `pita/conf/`.

Everything else is in pyproject.toml. A source checkout (and an editable install) reads
`conf/` in place; an installed wheel reads `pita/conf/` (pita/experiment/cli_extras.py).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConf(build_py):
    def run(self):
        super().run()
        source = Path(__file__).resolve().parent / "conf"
        target = Path(self.build_lib) / "pita" / "conf"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithConf})
