"""Package discovery for the flat layout: the root folder is `mleagle`, its subfolders its subpackages."""

from setuptools import find_packages, setup

TOP = ["engine", "daemon", "tui", "configs"]
subpackages = [f"mleagle.{p}" for p in find_packages(include=[f"{t}*" for t in TOP])]
setup(packages=["mleagle", *subpackages])
