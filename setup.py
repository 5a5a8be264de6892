"""Ships ``hybridmem_autoload.pth`` into site-packages so ``HYBRIDMEM_BUDGET=... python train.py`` works.

The .pth line imports nothing unless a HYBRIDMEM_* variable is set; all other metadata is in pyproject.toml.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "hybridmem_autoload.pth"


BENCH_TESTS = ("test_", "conftest")  # bench/'s pytest suites: run from a checkout, not shipped


class BuildPyWithPth(build_py):
    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        if package != "hybridmem.bench":
            return modules
        return [m for m in modules if not m[1].startswith(BENCH_TESTS)]

    def run(self) -> None:
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib) / PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class EditableWheelWithPth(editable_wheel):
    def _create_wheel_file(self, bdist_wheel):  # noqa: ANN001 - setuptools internal hook
        # The editable wheel maps packages to the source tree; the .pth must still land in site-packages.
        wheel = super()._create_wheel_file(bdist_wheel)
        import zipfile

        with zipfile.ZipFile(wheel, "a") as zf:
            if PTH not in zf.namelist():
                zf.write(PTH, PTH)
        return wheel


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
