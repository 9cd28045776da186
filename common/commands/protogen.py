"""Generate (or check) the committed protobuf/gRPC stubs from ``protos/``.

``python -m common.commands.protogen OUT`` regenerates the stubs into OUT (``common/proto``);
``--check`` regenerates into a temporary folder and exits non-zero when anything
differs, so ``make test`` fails if the committed stubs drift from the .proto files.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
PACKAGE_PREFIX = "common.proto"
_INIT = '"""Generated from protos/ by `make proto`; do not edit."""\n'


def _generate(out: Path) -> None:
    # grpc_tools: a development dependency, loaded only by `make proto`
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Generated code imports "medfed.v1"; make it absolute inside our package.
    for path in out.rglob("*.py*"):
        text = path.read_text()
        fixed = re.sub(r"^from medfed\.", f"from {PACKAGE_PREFIX}.medfed.", text, flags=re.M)
        fixed = re.sub(r"^import medfed\.", f"import {PACKAGE_PREFIX}.medfed.", fixed, flags=re.M)
        path.write_text(fixed)
    for folder in [out, *[p for p in out.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").write_text(_INIT)


def _files(root: Path) -> set[Path]:
    return {
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def _differences(a: Path, b: Path) -> list[str]:
    names_a, names_b = _files(a), _files(b)
    diffs = sorted(str(n) for n in names_a ^ names_b)
    for name in sorted(names_a & names_b):
        if not filecmp.cmp(a / name, b / name, shallow=False):
            diffs.append(str(name))
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "proto"
        fresh.mkdir()
        _generate(fresh)
        if args.check:
            diffs = _differences(fresh, args.out)
            if diffs:
                print("generated stubs drift from protos/ (run `make proto`):", file=sys.stderr)
                for d in diffs:
                    print(f"  {d}", file=sys.stderr)
                return 1
            print("protobuf stubs are up to date")
            return 0
        if args.out.exists():
            shutil.rmtree(args.out)
        shutil.copytree(fresh, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
