"""Print the pip requirements of one image, read from pyproject.toml (needs Python >= 3.11: tomllib).

pyproject.toml stays the only place dependencies are listed; the images ask it for the base
(serving) dependencies, an extra, or both, instead of keeping a second copy that drifts.

    python3 docker/requirements.py                         # serving image
    python3 docker/requirements.py --extra gpu --drop onnxruntime   # GPU image
    python3 docker/requirements.py --no-base --extra loadtest       # locust image
"""

import argparse
import re
import sys
from pathlib import Path

import tomllib


def distribution_name(requirement: str) -> str:
    """`onnxruntime>=1.18` -> `onnxruntime` (PEP 503 normalised)."""
    name = re.split(r"[\s\[<>=!~;@]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def image_requirements(pyproject: Path, extras: list[str], base: bool, drop: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"]) if base else []
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    # onnxruntime and onnxruntime-gpu install the same module; the GPU image must have only one.
    dropped = {distribution_name(name) for name in drop}
    return [r for r in requirements if distribution_name(r) not in dropped]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parents[1] / "pyproject.toml")
    parser.add_argument("--extra", action="append", default=[], help="optional-dependencies group to add")
    parser.add_argument("--no-base", action="store_true", help="leave out [project.dependencies]")
    parser.add_argument("--drop", action="append", default=[], help="distribution to leave out")
    args = parser.parse_args()
    requirements = image_requirements(args.pyproject, args.extra, not args.no_base, args.drop)
    sys.stdout.write("".join(f"{r}\n" for r in requirements))


if __name__ == "__main__":
    main()
